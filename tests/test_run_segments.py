"""Changing ``--steps`` on resume (issue 51, item 3): the learning-rate schedule belongs to the
run, a resume below the run's step is refused before anything is written, and every segment
(one invocation that trained) is on record in the checkpoint, ``tjax_config.json`` and the
run's README."""

import json
import os

import pytest

from transformers_jax import ModelConfig, TrainConfig, cli
from transformers_jax.config import ConfigError, from_dict
from transformers_jax.learning.optim import learning_rate_schedule
from transformers_jax.runs.checkpoint import Checkpointer
from transformers_jax.runs.meta import segments_of
from transformers_jax.runs.readme import CONFIG_FILE, run_readme
from transformers_jax.train.loop import train

MODEL = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2)


def run_cfg(tmp_path, **kw):
    base = dict(steps=10, batch_size=2, seq_len=16, log_every=1, eval_every=10, eval_batches=1,
                checkpoint_every=5, progress=False, tensorboard=False,
                run_dir=str(tmp_path / "run"))
    return TrainConfig(**{**base, **kw})


def rows(run_dir, kind):
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in lines if r["kind"] == kind]


def logged_rates(run_dir) -> dict[int, float]:
    return {r["step"]: r["learning_rate"] for r in rows(run_dir, "train")}


def files_of(run_dir) -> dict[str, bytes]:
    """Every file under ``run_dir`` with its bytes."""
    out = {}
    for folder, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, run_dir)] = f.read()
    return out


def test_schedule_steps_sets_the_schedule_and_later_steps_stay_at_the_floor():
    planned = learning_rate_schedule(TrainConfig(steps=100))
    longer = learning_rate_schedule(TrainConfig(steps=300, schedule_steps=100))
    for step in (0, 5, 10, 50, 99):
        assert float(longer(step)) == float(planned(step))
    floor = TrainConfig().learning_rate * TrainConfig().min_lr_ratio
    for step in (100, 150, 299):
        assert float(longer(step)) == pytest.approx(floor)
    assert TrainConfig(steps=300, schedule_steps=100).warmup == 10  # 10% of the schedule
    with pytest.raises(ConfigError, match="train.schedule_steps"):
        TrainConfig(schedule_steps=0)
    with pytest.raises(ConfigError, match="train.warmup_steps"):
        TrainConfig(steps=300, schedule_steps=100, warmup_steps=100)


@pytest.mark.slow
def test_a_longer_resume_keeps_the_runs_schedule_and_records_both_segments(tmp_path):
    """10 steps, then --steps 20: the rate goes on from the 10-step cosine's end (its floor),
    not from a new 20-step cosine (which would jump it up at step 11); the saved config
    reproduces every rate and loss of the two segments in one fresh run."""
    cfg = run_cfg(tmp_path)
    run = cfg.run_dir
    train(MODEL, cfg)
    train(MODEL, cfg.replace(steps=20))
    planned = learning_rate_schedule(cfg)  # the schedule the run started with
    rates = logged_rates(run)
    assert sorted(rates) == list(range(1, 21))
    for step, rate in rates.items():
        assert rate == pytest.approx(float(planned(step - 1)), rel=1e-6), step
    floor = cfg.learning_rate * cfg.min_lr_ratio
    assert rates[10] > rates[11] == pytest.approx(floor) == rates[20]  # the floor, no jump
    [note] = rows(run, "schedule")
    assert note["step"] == 10 and "keeps its learning-rate schedule" in note["message"]
    assert "steps 11-20 run at its final rate 2.00e-04" in note["message"]
    assert "--train.schedule_steps=N" in note["message"]
    assert not rows(run, "warning")

    saved = json.load(open(os.path.join(run, CONFIG_FILE)))
    assert (saved["train"]["steps"], saved["train"]["schedule_steps"]) == (20, 10)
    ends = [(s["start"], s["end"], s["steps"], s["schedule_steps"]) for s in saved["segments"]]
    assert ends == [(0, 10, 10, 10), (10, 20, 20, 10)]
    ckpt = Checkpointer(run)
    assert ckpt.read_meta(20)["segments"] == saved["segments"]
    ckpt.close()
    readme = open(os.path.join(run, "README.md")).read()
    assert "20 of 20 steps" in readme and "## Segments" in readme
    assert "| 0-10 | 10 | warm-up 1, cosine over 10 steps |" in readme
    assert "| 10-20 | 20 | warm-up 1, cosine over 10 steps, then flat to step 20 |" in readme

    # the saved config, trained afresh elsewhere, is the same run without the stop
    again = from_dict(TrainConfig, saved["train"]).replace(run_dir=str(tmp_path / "again"))
    final = train(MODEL, again)
    assert [h["learning_rate"] for h in final["history"]] == [rates[s] for s in range(1, 21)]
    losses = {r["step"]: r["loss"] for r in rows(run, "train")}
    assert [h["loss"] for h in final["history"]] == [losses[s] for s in range(1, 21)]
    assert len(json.load(open(os.path.join(again.run_dir, CONFIG_FILE)))["segments"]) == 1


@pytest.mark.slow
def test_schedule_steps_on_resume_replans_the_rate_with_a_warning(tmp_path):
    cfg = run_cfg(tmp_path)
    train(MODEL, cfg)
    train(MODEL, cfg.replace(steps=20, schedule_steps=20))
    old, new = learning_rate_schedule(cfg), learning_rate_schedule(cfg.replace(steps=20))
    rates = logged_rates(cfg.run_dir)
    for step in range(11, 21):
        assert rates[step] == pytest.approx(float(new(step - 1)), rel=1e-6), step
    [warned] = [r["message"] for r in rows(cfg.run_dir, "warning")]
    assert "schedule changes from 10 to 20 steps" in warned
    assert f"rate at step 11 goes from {float(old(10)):.2e} to {float(new(10)):.2e}" in warned
    assert not rows(cfg.run_dir, "schedule")
    saved = json.load(open(os.path.join(cfg.run_dir, CONFIG_FILE)))
    assert [s["schedule_steps"] for s in saved["segments"]] == [10, 20]


@pytest.mark.slow
def test_a_shorter_resume_is_refused_and_leaves_the_run_as_it_was(tmp_path, capsys):
    """--steps below the run's step trains nothing and rewrites nothing (README, config,
    metrics, checkpoints, TensorBoard files: every byte); --steps at the run's step trains
    nothing and writes nothing either."""
    cfg = run_cfg(tmp_path, steps=8, checkpoint_every=4, eval_every=8, tensorboard=True)
    run = cfg.run_dir
    train(MODEL, cfg)
    before = files_of(run)
    assert "README.md" in before and CONFIG_FILE in before
    with pytest.raises(ValueError, match="is at step 8, past --steps 4") as err:
        train(MODEL, cfg.replace(steps=4))
    assert "--steps above 8" in str(err.value) and "new --run-dir" in str(err.value)
    assert files_of(run) == before

    argv = ["train", "--model.n_layers=1", "--model.d_model=32", "--model.n_heads=2",
            "--train.batch_size=2", "--train.seq_len=16", "--steps", "4", "--run-dir", run]
    assert cli.main(argv) == 2
    assert "is at step 8, past --steps 4" in capsys.readouterr().err
    assert files_of(run) == before

    final = train(MODEL, cfg)  # the same command again: the run is complete
    assert final["steps"] == 8 and final["history"] == []
    assert "nothing to train" in capsys.readouterr().err
    assert files_of(run) == before


def test_segments_of_an_older_checkpoint_and_their_readme_rows():
    older = {"step": 60, "train": {"steps": 60, "warmup_steps": None}}  # saved before segments
    assert segments_of(older) == [{"start": 0, "end": 60, "steps": 60, "schedule_steps": 60,
                                    "warmup_steps": 6, "command": None}]
    assert segments_of({"step": 0, "train": {"steps": 600}}) == []  # a converted run
    segments = [*segments_of(older), {"start": 60, "end": 120, "steps": 120,
                                       "schedule_steps": 60, "warmup_steps": 6,
                                       "command": "tjax train --data 'a|b' --steps 120"}]
    cfg = TrainConfig(steps=120, schedule_steps=60)
    final = {"steps": 120, "params": 1000, "train_loss": 2.5, "eval_loss": 2.25,
             "eval_accuracy": None, "tokens_per_s": 1000.0, "mfu": 0.01, "stopped_by": None}
    text = run_readme("runs/x", MODEL, cfg, final, data_description="text", tokenizer="byte",
                      command=segments[-1]["command"], segments=segments)
    assert "| 0-60 | 60 | warm-up 6, cosine over 60 steps | (not recorded) |" in text
    assert ("| 60-120 | 120 | warm-up 6, cosine over 60 steps, then flat to step 120 | "
            "`tjax train --data 'a\\|b' --steps 120` |") in text
    assert "(warm-up 6, cosine over 60 steps, then flat to step 120)" in text
    assert "The command of its latest segment" in text
    one = run_readme("runs/x", MODEL, TrainConfig(steps=60), {**final, "steps": 60},
                     data_description="text", tokenizer="byte", segments=segments[:1])
    assert "## Segments" not in one
