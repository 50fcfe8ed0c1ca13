"""Reliability: a diverged run stops before saving anything non-finite, bad updates can be
skipped, loss spikes are reported with their batch's position, and a run directory has one
writer."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.errors import NonFiniteError, RunDirLockedError
from transformers_jax.learning import step as train_step_module
from transformers_jax.runs import load_run
from transformers_jax.runs.checkpoint import Checkpointer
from transformers_jax.runs.lock import LOCK_FILE, RunLock
from transformers_jax.train.guard import SPIKE_WARMUP, Guard
from transformers_jax.train.loop import train

TINY = ["--model.n_layers=1", "--model.d_model=32", "--model.n_heads=2",
        "--train.batch_size=4", "--train.seq_len=32", "--train.eval_batches=1", "--no-progress"]
MODEL = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2)


def rows(run_dir, kind):
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in lines if r["kind"] == kind]


def all_finite(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------------ non-finite guard
@pytest.mark.slow
def test_the_issue_recipe_stops_non_zero_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """learning_rate=1e4 (the issue's recipe, warmed up over the run so the first steps are
    finite): the CLI exits 1 naming the step and the fixes; every checkpoint is finite. (The
    CLI's main in this process: ``tjax`` is ``sys.exit(main())``, one device by default.)"""
    from transformers_jax import cli

    run = str(tmp_path / "run")
    code = cli.main(["train", *TINY, "--steps", "60", "--train.learning_rate=1e4",
                     "--train.warmup_steps=59", "--train.log_every=5",
                     "--train.checkpoint_every=1", "--train.tensorboard=false", "--run-dir", run])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "training diverged at step" in err and "last finite loss" in err
    assert "learning_rate" in err and "float32" in err and "grad_clip" in err
    bad = int(err.split("training diverged at step ")[1].split(":")[0])
    ckpt = Checkpointer(run)
    latest = ckpt.latest_step()
    ckpt.close()
    assert latest == bad - 1  # nothing lost beyond the last save, nothing non-finite saved
    assert all_finite(load_run(run)[1])
    assert all(np.isfinite(r["loss"]) for r in rows(run, "train"))  # never logged 'loss nan'


def poison_update_at(monkeypatch, bad_step: int):
    """Make update number ``bad_step`` (1-based) non-finite inside the jitted step: its loss
    and its gradients become NaN, as a diverging batch would make them."""
    real = train_step_module.apply_gradients  # what every strategy's update calls

    def poisoned(optimizer, state, grads, metrics, schedule, rng):
        hit = state.step + 1 == bad_step
        grads = jax.tree.map(lambda g: jnp.where(hit, jnp.nan, g), grads)
        metrics = {**metrics, "loss": jnp.where(hit, jnp.nan, metrics["loss"])}
        return real(optimizer, state, grads, metrics, schedule, rng)

    monkeypatch.setattr(train_step_module, "apply_gradients", poisoned)


def small_cfg(tmp_path, **kw):
    base = dict(steps=8, batch_size=2, seq_len=16, log_every=4, eval_every=8, eval_batches=1,
                checkpoint_every=2, progress=False, tensorboard=False,
                run_dir=str(tmp_path / "run"))
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_a_bad_update_is_skipped_inside_the_step_when_allowed(tmp_path, monkeypatch):
    poison_update_at(monkeypatch, 3)
    final = train(MODEL, small_cfg(tmp_path, skip_nonfinite_steps=1))
    assert final["steps"] == 8 and np.isfinite(final["train_loss"])
    assert final["history"][0]["skipped"] == 1  # the window of steps 1-4 skipped one
    warned = rows(tmp_path / "run", "warning")
    assert [r["step"] for r in warned] == [3] and "update skipped" in warned[0]["message"]
    assert all_finite(load_run(str(tmp_path / "run"))[1])


@pytest.mark.slow
def test_a_bad_update_past_the_budget_stops_before_saving(tmp_path, monkeypatch):
    poison_update_at(monkeypatch, 3)
    with pytest.raises(NonFiniteError, match="diverged at step 3") as err:
        train(MODEL, small_cfg(tmp_path))
    assert "last finite loss" in str(err.value) and "at step 2" in str(err.value)
    ckpt = Checkpointer(str(tmp_path / "run"))
    assert ckpt.all_steps() == [2]  # the save of step 4 checked the metrics first
    ckpt.close()
    assert all_finite(load_run(str(tmp_path / "run"))[1])
    # the directory is free again and the run resumes from the last good step
    monkeypatch.undo()
    assert train(MODEL, small_cfg(tmp_path))["steps"] == 8


def test_guard_counts_skips_and_reports_spikes_with_the_data_position():
    said = []
    guard = Guard(skip_budget=1, warn=lambda step, text: said.append((step, text)))
    rng = np.random.default_rng(0)
    for step in range(1, SPIKE_WARMUP + 10):
        guard.check(step, {"loss": 2.0 + 0.01 * rng.standard_normal(), "grad_norm": 1.0},
                    {"offset": step})
    assert not said
    guard.check(100, {"loss": 5.0, "grad_norm": 1.0}, {"offset": 99})
    assert guard.spikes == [100] and "{'offset': 99}" in said[-1][1]
    guard.check(101, {"loss": float("nan"), "grad_norm": 1.0})
    assert guard.skipped == [101] and "skipped (1 of at most 1" in said[-1][1]
    with pytest.raises(NonFiniteError, match="at step 102.*last finite loss was 5.0000"):
        guard.check(102, {"loss": 1.0, "grad_norm": float("inf")})


# ------------------------------------------------------------------------ one writer
HOLD = ("import sys, time; from transformers_jax.runs.lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")


def hold_lock(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, run_dir], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_on_the_run_dir_fails_naming_the_holder(tmp_path, capsys):
    from transformers_jax import cli

    run = str(tmp_path / "run")
    holder = hold_lock(run)
    try:
        with pytest.raises(RunDirLockedError, match=f"in use by process {holder.pid} on"):
            RunLock(run).acquire()
        start = time.time()
        code = cli.main(["train", *TINY, "--steps", "2", "--run-dir", run])  # this process
        assert code == 1 and f"process {holder.pid}" in capsys.readouterr().err
        assert time.time() - start < 60  # at once: before any data or compile
        assert not os.path.exists(os.path.join(run, "checkpoints"))
    finally:
        holder.kill()
        holder.wait()
    # SIGKILL left the file naming a dead process: the next run takes it over, with a warning
    said = []
    lock = RunLock(run, said.append).acquire()
    assert f"stale lock of process {holder.pid}" in said[0] and "not running" in said[0]
    lock.release()
    assert open(os.path.join(run, LOCK_FILE)).read() == ""  # released: emptied


@pytest.mark.slow
def test_a_stale_lock_file_with_a_dead_pid_is_taken_over_by_a_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    final = train(MODEL, small_cfg(tmp_path, steps=2))
    assert final["steps"] == 2
    warned = rows(str(run), "warning")
    assert warned[0]["step"] == 0 and f"stale lock of process {dead.pid}" in warned[0]["message"]
    assert (run / LOCK_FILE).read_text() == ""



# ------------------------------------------------------------------------ resume checks
def text_cfg(tmp_path, **kw):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    return small_cfg(tmp_path, data=str(corpus), steps=2, **kw)


@pytest.mark.slow
def test_resume_refuses_changed_data_contents_unless_accepted(tmp_path):
    cfg = text_cfg(tmp_path)
    train(MODEL, cfg)
    (tmp_path / "corpus.txt").write_text("a wholly different text, same file name\n" * 300)
    with pytest.raises(ValueError, match=r"data contents: checkpoint read .*corpus.txt.* "
                       r"\[local-text:\w+\], this run reads .*corpus.txt") as err:
        train(MODEL, cfg.replace(steps=4))
    assert "accept_data_change=true" in str(err.value)
    final = train(MODEL, cfg.replace(steps=4, accept_data_change=True))
    assert final["steps"] == 4
    warned = [r["message"] for r in rows(cfg.run_dir, "warning")]
    assert any("other data" in m and "(the same --data, whose contents changed)" in m
               for m in warned)


@pytest.mark.slow
def test_resume_onto_other_data_names_both_sources(tmp_path):
    """Another --data is a changed setting, not changed files; the built-in corpus is named as
    such."""
    cfg = small_cfg(tmp_path, steps=2)  # the built-in corpus
    train(MODEL, cfg)
    other = text_cfg(tmp_path).replace(steps=4)
    with pytest.raises(ValueError) as err:
        train(MODEL, other.replace(run_dir=cfg.run_dir))
    text = str(err.value)
    assert f"data: checkpoint has None, asked for {other.data!r}" in text
    assert "the same --data" not in text
    assert re.search(r"checkpoint read the default corpus [^\[]*\[local-text:", text), text


@pytest.mark.slow
def test_resume_refuses_a_changed_window_layout(tmp_path):
    """bos_per_row and shuffle_rows change what the rows hold and their order: a resume that
    changes either is refused, and a checkpoint saved without them on record reads as saved
    with both off: such a run resumes with rows unshuffled, and under today's default (rows
    shuffled) it is refused with the option that resumes it."""
    cfg = text_cfg(tmp_path).replace(shuffle_rows=0)
    train(MODEL, cfg)
    for change in ({"bos_per_row": True}, {"shuffle_rows": 8}):
        with pytest.raises(ValueError, match=next(iter(change))):
            train(MODEL, cfg.replace(steps=4, **change))
    meta_file = os.path.join(cfg.run_dir, "checkpoints", "2", "meta", "metadata")  # orbax JSON
    meta = json.load(open(meta_file))
    del meta["data"]["spec"]["bos_per_row"], meta["data"]["spec"]["shuffle_rows"]
    json.dump(meta, open(meta_file, "w"))
    os.remove(os.path.join(cfg.run_dir, "checkpoints", "2", "tjax_files.json"))  # none then
    for change in ({"bos_per_row": True}, {"shuffle_rows": 8}):
        with pytest.raises(ValueError, match=next(iter(change))):
            train(MODEL, cfg.replace(steps=4, **change))
    with pytest.raises(ValueError, match="with --train.shuffle_rows=0"):
        train(MODEL, cfg.replace(steps=4, shuffle_rows=None))  # today's default
    assert train(MODEL, cfg.replace(steps=4))["steps"] == 4


@pytest.mark.slow
def test_resume_with_the_same_settings_reports_no_difference(tmp_path):
    from transformers_jax.runs.checkpoint import config_differences

    assert config_differences({"test_lengths": [21, 80]}, {"test_lengths": (21, 80)}) == []
    assert config_differences({"a": {"b": [1, [2]]}}, {"a": {"b": (1, (2,))}}) == []
    cfg = text_cfg(tmp_path)
    train(MODEL, cfg)
    train(MODEL, cfg.replace(steps=4))
    assert rows(cfg.run_dir, "resume") and not rows(cfg.run_dir, "warning")


@pytest.mark.slow
def test_a_checkpoint_older_than_the_data_records_still_resumes(tmp_path):
    cfg = text_cfg(tmp_path)
    train(MODEL, cfg)
    meta_file = os.path.join(cfg.run_dir, "checkpoints", "2", "meta", "metadata")  # orbax JSON
    meta = json.load(open(meta_file))
    del meta["data"]["spec"], meta["data"]["fingerprint"]
    meta["tokenizer"] = {"kind": meta["tokenizer"]["kind"], "dir": "tokenizer"}
    json.dump(meta, open(meta_file, "w"))
    os.remove(os.path.join(cfg.run_dir, "checkpoints", "2", "tjax_files.json"))  # none then
    assert train(MODEL, cfg.replace(steps=4))["steps"] == 4
    [warned] = [r["message"] for r in rows(cfg.run_dir, "warning")]
    assert "predates data fingerprints" in warned


# ------------------------------------------------------------------------ checkpoint damage
@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_the_run_falls_back_to_the_previous(tmp_path):
    from transformers_jax.errors import CheckpointDamagedError

    cfg = small_cfg(tmp_path, steps=4)
    train(MODEL, cfg)
    arrays = os.path.join(cfg.run_dir, "checkpoints", "4", "state", "ocdbt.process_0", "d")
    files = sorted(os.listdir(arrays), key=lambda f: os.path.getsize(os.path.join(arrays, f)))
    with open(os.path.join(arrays, files[-1]), "r+b") as f:  # truncate the largest array file
        f.truncate(os.path.getsize(os.path.join(arrays, files[-1])) // 2)
    os.remove(os.path.join(arrays, files[0]))  # and delete another
    with pytest.raises(CheckpointDamagedError, match="step 4 .* is damaged") as err:
        load_run(cfg.run_dir, step=4)
    message = str(err.value)
    assert files[-1] in message and f"{files[0]} (missing)" in message
    assert message.endswith("load an intact one with --step 2")
    final = train(MODEL, cfg.replace(steps=6))  # resumes from step 2, with a warning
    assert final["steps"] == 6
    assert [r["step"] for r in rows(cfg.run_dir, "resume")] == [2]
    assert any("step 4" in r["message"] and "damaged" in r["message"]
               for r in rows(cfg.run_dir, "warning"))
    assert os.listdir(os.path.join(cfg.run_dir, "damaged_checkpoints"))[0].startswith("4-")
    assert all_finite(load_run(cfg.run_dir)[1])  # steps 4 and 6 written afresh


def zero_largest_file(step_dir: str) -> str:
    """Overwrite the step's largest file with zeros at its size (what a bad copy or a failing
    disk can leave: no size changes) and return its path within the step."""
    paths = [os.path.join(d, name) for d, _, names in os.walk(step_dir) for name in names]
    largest = max(paths, key=os.path.getsize)
    size = os.path.getsize(largest)
    with open(largest, "r+b") as f:
        f.write(bytes(size))
    return os.path.relpath(largest, step_dir)


@pytest.mark.slow
def test_a_zeroed_checkpoint_file_is_named_and_sample_and_train_fall_back(tmp_path, capsys):
    from transformers_jax import cli

    cfg = small_cfg(tmp_path, steps=4)
    train(MODEL, cfg)
    zeroed = zero_largest_file(os.path.join(cfg.run_dir, "checkpoints", "4"))
    said = f"{zeroed} (the same size, other contents than saved"
    capsys.readouterr()
    sample = ["sample", "--run", cfg.run_dir, "--max-new-tokens", "3", "--temperature", "0"]
    assert cli.main(sample) == 0  # no --step: the newest intact step, with one warning line
    [warned] = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert warned.startswith("warning: the checkpoint of step 4 in ") and said in warned
    assert warned.endswith("; loading step 2, the newest intact one")
    assert cli.main([*sample, "--step", "4"]) == 2  # asked for: refused in one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("tjax sample: error: the checkpoint of step 4 in ") and said in err
    assert err.rstrip().endswith("; load an intact one with --step 2")
    final = train(MODEL, cfg.replace(steps=6))  # resumes from step 2, with a warning
    assert final["steps"] == 6 and [r["step"] for r in rows(cfg.run_dir, "resume")] == [2]
    [warned] = [r["message"] for r in rows(cfg.run_dir, "warning")]
    assert "step 4" in warned and said in warned and "resuming from an earlier step" in warned
    assert "step=" not in warned


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_run_and_keeps_the_previous(tmp_path, monkeypatch):
    import errno

    import orbax.checkpoint as ocp

    from transformers_jax.errors import CheckpointWriteError

    real = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    cfg = small_cfg(tmp_path)
    with pytest.raises(CheckpointWriteError, match="step 4 .*No space left.*latest good: step 2"):
        train(MODEL, cfg)
    monkeypatch.undo()
    ckpt = Checkpointer(cfg.run_dir)
    assert ckpt.all_steps() == [2] and not ckpt.verify(2)
    ckpt.close()
    assert all_finite(load_run(cfg.run_dir)[1])
    assert train(MODEL, cfg)["steps"] == 8  # the same command resumes from step 2
