"""Seeds trained together (``train.seeds.train_seeds``): each seed trains as it would alone.

Tolerance. The program maps the single-device step over the seeds (``lax.map`` on the CPU,
``jax.vmap`` on accelerators, both tested here), so XLA compiles the step inside a loop or with
batched products ``[S, ...]``, and may fuse, block and sum in another order than the solo run:
each operation can differ in its last float32 bit (relative 6e-8). Losses must agree to a
relative 1e-5 and parameters after 8 AdamW steps to 2e-5 absolute. Adam divides by the root of
the second moment, so a rounding difference in a near-zero gradient can move an update by a
visible fraction of the learning rate (2e-3 here), but no further; a wrong batch, seed or key
moves losses by 1e-2 and parameters by 1e-3, far outside these bounds. Observed (2026-12-06):
``lax.map`` equal bit for bit in these tests, and at XLA's default optimisation level equal
parameters with losses 9e-8 apart; ``jax.vmap`` on the CPU, parameters 3e-7 apart after 6
steps (3e-6 with gradient accumulation).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from subprocess_env import single_device_env

from transformers_jax import ModelConfig, TrainConfig, backends
from transformers_jax.backends import Backend
from transformers_jax.config import ConfigError
from transformers_jax.learning.objectives import run_objective
from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer
from transformers_jax.parallel import make_trainer, stack_seeds
from transformers_jax.parallel.seeds import seed_devices
from transformers_jax.runs import load_run
from transformers_jax.runs.checkpoint import Checkpointer
from transformers_jax.train.loop import train
from transformers_jax.train.seeds import train_seeds

LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5

GPT = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=32, dropout=0.1)
BERT = GPT.replace(family="bert", mask={"name": "bidirectional"})
CFG = TrainConfig(steps=8, batch_size=4, seq_len=32, log_every=1, eval_every=4, eval_batches=1,
                  checkpoint_every=4, progress=False, tensorboard=False)


def losses(result: dict) -> list[float]:
    return [row["loss"] for row in result["history"]]


def params_of(run_dir: str):
    _, params, _, _ = load_run(run_dir)
    return jax.tree.map(np.asarray, params)


def assert_same_run(together: dict, alone: dict, together_dir: str, alone_dir: str) -> None:
    np.testing.assert_allclose(losses(together), losses(alone), rtol=LOSS_RTOL)
    assert together["eval_loss"] == pytest.approx(alone["eval_loss"], rel=LOSS_RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=PARAM_ATOL),
                 params_of(together_dir), params_of(alone_dir))


@pytest.mark.slow
def test_gpt_seeds_together_equal_solo_runs_and_resume_alone_or_together(tmp_path, capsys):
    """Two GPT seeds (dropout on) trained together for 4 steps, then continued together to 8,
    equal solo runs of 8 steps; a copy of one seed's directory continued alone does too."""
    dirs = [str(tmp_path / f"seed{s}") for s in (0, 1)]
    first = train_seeds(GPT, CFG.replace(steps=4, schedule_steps=8), [0, 1], dirs)
    # each seed's console lines say whose they are
    lines = [line for line in capsys.readouterr().err.splitlines() if "| loss " in line]
    assert lines and {line.split(" | ")[0] for line in lines} == {"seed 0", "seed 1"}, lines
    assert [r["steps"] for r in first] == [4, 4] and first[0]["seeds_together"] == 2
    assert losses(first[0]) != losses(first[1])  # two seeds, not one twice
    alone_dir = str(tmp_path / "seed1-alone")
    shutil.copytree(dirs[1], alone_dir)

    rest = train_seeds(GPT, CFG, [0, 1], dirs)  # resumes both from step 4
    assert [r["history"][0]["step"] for r in rest] == [5, 5]
    solo = [train(GPT, CFG.replace(seed=s, run_dir=str(tmp_path / f"solo{s}"))) for s in (0, 1)]
    for s in (0, 1):
        joined = {**rest[s], "history": first[s]["history"] + rest[s]["history"]}
        assert_same_run(joined, solo[s], dirs[s], str(tmp_path / f"solo{s}"))

    resumed = train(GPT, CFG.replace(seed=1, run_dir=alone_dir))  # one seed, alone
    assert resumed["history"][0]["step"] == 5
    assert_same_run({**resumed, "history": first[1]["history"] + resumed["history"]}, solo[1],
                    alone_dir, str(tmp_path / "solo1"))

    # each directory is an ordinary run of its own seed
    saved = json.load(open(os.path.join(dirs[1], "tjax_config.json")))["train"]
    assert saved["seed"] == 1 and saved["run_dir"] == dirs[1]
    assert Checkpointer(dirs[1]).all_steps() == [4, 8]
    assert "one of 2 seeds" in open(os.path.join(dirs[1], "README.md")).read()
    # all at step 8 already: nothing to train
    assert train_seeds(GPT, CFG, [0, 1], dirs) == [{"steps": 8, "stopped_by": None,
                                                    "history": []}] * 2


@pytest.mark.slow
def test_bert_seeds_together_equal_solo_runs_with_grad_accum(tmp_path):
    cfg = CFG.replace(steps=3, grad_accum=2, eval_every=3, checkpoint_every=3)
    dirs = [str(tmp_path / f"seed{s}") for s in (3, 7)]
    together = train_seeds(BERT, cfg, [3, 7], dirs)
    alone_dir = str(tmp_path / "solo7")  # one seed alone is enough here (the GPT test: both)
    assert_same_run(together[1], train(BERT, cfg.replace(seed=7, run_dir=alone_dir)), dirs[1],
                    alone_dir)


@pytest.mark.slow
def test_vmap_and_map_over_seeds_step_as_solo_steps():
    """Both ways a backend maps the step over seeds (``Programs.map_seeds``: ``jax.vmap`` for
    TPU/GPU, tested here on the CPU; ``lax.map`` for XLA:CPU) give each seed its solo steps."""
    objective = run_objective(GPT, None)
    model = objective.build(GPT, None)
    rng = np.random.default_rng(0)
    batches = [[{"inputs": rng.integers(0, 262, (4, 32)).astype(np.int32),
                 "targets": rng.integers(0, 262, (4, 32)).astype(np.int32),
                 "weights": np.ones((4, 32), np.float32)} for _ in range(2)] for _ in range(2)]
    trainer = make_trainer("single", model, make_optimizer(CFG), batches[0][0],
                           schedule=learning_rate_schedule(CFG), objective=objective)
    alone = []
    for seed in (0, 1):
        state = trainer.init_state(seed)
        for batch in batches[seed]:
            state, metrics = trainer.step(state, batch)
        alone.append((float(metrics["loss"]), jax.device_get(state.params)))
    for backend in (Backend("cpu"), backends.for_platform("cpu")):
        seeds = stack_seeds(trainer, 2, backend=backend)
        state = seeds.init([0, 1])
        for step in range(2):
            state, metrics = seeds.step(state, seeds.place_batch([b[step] for b in batches]))
        for seed in (0, 1):
            assert float(metrics["loss"][seed]) == pytest.approx(alone[seed][0], rel=LOSS_RTOL)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=PARAM_ATOL),
                         jax.device_get(seeds.unstack(state, seed).params), alone[seed][1])


LSTM_INIT = """
import jax
import numpy as np
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.models import build_model
from transformers_jax.parallel import make_trainer, stack_seeds
from transformers_jax.learning.optim import make_optimizer
model = build_model(ModelConfig(family="lstm", vocab_size=4096, d_model=192, n_layers=2))
batch = {"inputs": np.zeros((4, 32), np.int32), "targets": np.zeros((4, 32), np.int32)}
trainer = make_trainer("single", model, make_optimizer(TrainConfig()), batch)
seeds = stack_seeds(trainer, 3)
fresh = seeds.init([0, 1, 2])
alone = trainer.init_state(2)
jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
             seeds.unstack(fresh, 2).params, alone.params)
print("initialised")
"""


@pytest.mark.slow
def test_stacked_lstm_initialisation_finishes_on_cpu():
    """A vmapped initialisation of this LSTM never finished on XLA:CPU (jax 0.10.2); the CPU
    backend maps it seed by seed, and seed 2's slice is its own init. In a process of its
    own, so that a hang fails the test instead of stopping the suite."""
    done = subprocess.run([sys.executable, "-c", LSTM_INIT], capture_output=True, text=True,
                          timeout=300, env=single_device_env())
    assert done.returncode == 0 and "initialised" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_seeds_over_a_seed_mesh_axis_train_as_on_one_device(tmp_path):
    """Four GPT seeds laid over a ``seed`` mesh axis of two (fake CPU) devices, two whole
    seeds on each, train as the same four seeds on one device: the same losses, evaluation and
    parameters, each in its own run directory."""
    devices = jax.devices()[:2]
    assert len(devices) == 2, "tests/conftest.py gives the CPU 8 devices"
    cfg = CFG.replace(steps=4, eval_every=2, checkpoint_every=4)
    one = [str(tmp_path / f"one{s}") for s in range(4)]
    two = [str(tmp_path / f"two{s}") for s in range(4)]
    on_one = train_seeds(GPT, cfg, [0, 1, 2, 3], one)  # the CPU default: its first device
    on_two = train_seeds(GPT, cfg, [0, 1, 2, 3], two, devices=devices)
    for s in range(4):
        assert_same_run(on_two[s], on_one[s], two[s], one[s])
    assert len({round(r["eval_loss"], 6) for r in on_two}) == 4  # four seeds, not one

    objective = run_objective(GPT, None)
    batch = {"inputs": np.zeros((4, 32), np.int32), "targets": np.zeros((4, 32), np.int32),
             "weights": np.ones((4, 32), np.float32)}
    trainer = make_trainer("single", objective.build(GPT, None), make_optimizer(CFG), batch,
                           objective=objective)
    seeds = stack_seeds(trainer, 4, devices=devices)
    state, _ = seeds.step(seeds.init([0, 1, 2, 3]), seeds.place_batch([batch] * 4))
    leaf = jax.tree.leaves(state.params)[0]
    assert {d.id for d in leaf.sharding.device_set} == {d.id for d in devices}
    assert [shard.data.shape[0] for shard in leaf.addressable_shards] == [2, 2]
    with pytest.raises(ConfigError, match="3 seeds over 2 devices.*multiple of 2"):
        stack_seeds(trainer, 3, devices=devices)


def test_seeds_spread_over_devices_where_the_backend_gains(monkeypatch):
    """By default seeds spread over as many devices as divide them on an accelerator's backend,
    and stay on one CPU device (its "devices" share one host's cores)."""
    cpus = jax.devices()
    assert seed_devices(8, cpus) == cpus[:1]

    class Spreads(backends.Programs):
        seeds_across_devices = True

    monkeypatch.setattr(backends, "for_devices",
                        lambda devices: Backend("tpu", programs=Spreads("tpu")))
    assert seed_devices(8, cpus) == cpus[:8]
    assert seed_devices(4, cpus) == cpus[:4]
    assert seed_devices(6, cpus) == cpus[:6] and seed_devices(3, cpus[:2]) == cpus[:1]


def test_bad_requests_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="each seed once"):
        train_seeds(GPT, CFG, [0, 0])
    with pytest.raises(ValueError, match="2 run directories for 3 seeds"):
        train_seeds(GPT, CFG, [0, 1, 2], ["a", "b"])
    with pytest.raises(ValueError, match="a directory of its own"):
        train_seeds(GPT, CFG, [0, 1], [str(tmp_path / "a"), str(tmp_path / "a/")])
    with pytest.raises(TypeError, match="one per seed"):
        train_seeds(GPT, CFG, [0], str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="train.strategy='jit'.*one after another"):
        train_seeds(GPT, CFG.replace(strategy="jit"), [0, 1])


@pytest.mark.slow
def test_runs_at_different_steps_are_refused_and_left_as_they_were(tmp_path):
    # runs at different steps cannot continue together (and nothing is written)
    done = str(tmp_path / "done")
    train(GPT, CFG.replace(steps=2, checkpoint_every=2, eval_every=2, run_dir=done))
    fresh = str(tmp_path / "fresh")
    with pytest.raises(ValueError, match=f"different steps.*{done}: 2.*{fresh}: 0"):
        train_seeds(GPT, CFG, [0, 1], [done, fresh])
    assert not os.path.exists(os.path.join(fresh, "checkpoints"))
