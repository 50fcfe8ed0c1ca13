"""Checkpoints: exact resume after a crash or a signal, safe saves, clear errors, restore
anywhere, and sampling from a restored run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from subprocess_env import single_device_env

from transformers_jax import ModelConfig, TrainConfig, cli
from transformers_jax.runs import load_run
from transformers_jax.runs.checkpoint import Checkpointer, CheckpointMismatchError
from transformers_jax.sample import SamplingConfig, generate
from transformers_jax.train.loop import train

TINY = ["--model.n_layers=1", "--model.d_model=32", "--model.n_heads=2", "--model.dropout=0.1",
        "--train.batch_size=4", "--train.seq_len=32", "--train.log_every=1",
        "--train.eval_batches=1", "--no-progress"]
# the processes that are killed and resumed: no TensorBoard (its import of torch and the
# greedy sample it logs at each evaluation cost each process seconds, and are not resumed state)
KILLED = [*TINY, "--train.tensorboard=false"]


def tjax(*args, timeout=300, crash_after=None):
    """``tjax ARGS`` in a process of its own; with ``crash_after=N``, one that SIGKILLs itself
    after step N (``crash_train.py``: the training loop's ``on_step`` hook)."""
    exe = [os.path.join(os.path.dirname(sys.executable), "tjax")]
    if crash_after is not None:
        exe = [sys.executable, os.path.join(os.path.dirname(__file__), "crash_train.py"),
               str(crash_after)]
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=timeout,
                          env=single_device_env())


def losses(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    by_step = {}
    for row in rows:
        if row["kind"] == "train":
            by_step[row["step"]] = row["loss"]  # a resumed run logs later steps again
    return by_step


def params_of(run_dir):
    _, params, _, _ = load_run(run_dir)
    return jax.tree.map(np.asarray, params)


@pytest.mark.slow
def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    common = ["train", *KILLED, "--steps", "12", "--train.checkpoint_every=3"]
    straight, crashed = str(tmp_path / "straight"), str(tmp_path / "crashed")
    assert tjax(*common, "--run-dir", straight).returncode == 0
    died = tjax(*common, "--run-dir", crashed, crash_after=7)
    assert died.returncode == -signal.SIGKILL  # killed mid-run, not a clean exit
    assert Checkpointer(crashed).latest_step() in (3, 6)  # never a half-written step
    resumed = tjax(*common, "--run-dir", crashed)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    a, b = losses(straight), losses(crashed)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s] for s in range(1, 13)] == [b[s] for s in range(1, 13)]  # bit for bit
    jax.tree.map(np.testing.assert_array_equal, params_of(straight), params_of(crashed))


@pytest.mark.slow
def test_sigterm_saves_then_resumes(tmp_path):
    run = str(tmp_path / "run")
    exe = os.path.join(os.path.dirname(sys.executable), "tjax")
    env = single_device_env()
    proc = subprocess.Popen([exe, "train", *KILLED, "--steps", "100000", "--run-dir", run,
                             "--train.checkpoint_every=100000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(metrics) and losses(run)):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM: saved step" in err
    saved = Checkpointer(run).latest_step()
    assert saved == max(losses(run)) and saved < 100000, (os.listdir(run + "/checkpoints"), err)
    result = tjax("train", *KILLED, "--steps", str(saved + 2), "--run-dir", run)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {run} at step {saved}" in result.stderr
    assert Checkpointer(run).latest_step() == saved + 2


def small_cfgs(tmp_path, **model):
    model_cfg = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, **model)
    train_cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, log_every=2, eval_every=4,
                            eval_batches=1, checkpoint_every=2, progress=False,
                            tensorboard=False, run_dir=str(tmp_path / "run"))
    return model_cfg, train_cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``small_cfgs``'s 4-step run, trained once for the tests that read it (checkpoints at
    steps 2 and 4); a test that changes it works on ``copy_of_trained``."""
    model_cfg, train_cfg = small_cfgs(tmp_path_factory.mktemp("trained"))
    train(model_cfg, train_cfg)
    return model_cfg, train_cfg


@pytest.fixture
def copy_of_trained(trained, tmp_path):
    model_cfg, train_cfg = trained
    shutil.copytree(train_cfg.run_dir, tmp_path / "run")
    return model_cfg, train_cfg.replace(run_dir=str(tmp_path / "run"))


def test_half_written_checkpoint_is_never_latest(copy_of_trained):
    model_cfg, train_cfg = copy_of_trained
    ckpt_dir = os.path.join(train_cfg.run_dir, "checkpoints")
    # what a save killed half-way leaves: a temporary directory that was never renamed
    partial = os.path.join(ckpt_dir, "6.orbax-checkpoint-tmp-1234567")
    os.makedirs(os.path.join(partial, "state"))
    open(os.path.join(partial, "state", "junk"), "w").write("half")
    assert Checkpointer(train_cfg.run_dir).latest_step() == 4
    _, params, _, _ = load_run(train_cfg.run_dir)
    assert jax.tree.leaves(params)


@pytest.mark.slow
def test_config_mismatch_names_the_fields(copy_of_trained):
    model_cfg, train_cfg = copy_of_trained
    with pytest.raises(CheckpointMismatchError) as err:
        train(model_cfg.replace(n_layers=2, position="alibi"), train_cfg.replace(steps=6))
    message = str(err.value)
    assert "n_layers: checkpoint has 1, asked for 2" in message
    assert "position: checkpoint has 'rope', asked for 'alibi'" in message
    assert "new --run-dir" in message


def test_a_resume_takes_the_runs_settings_and_checks_what_is_given(copy_of_trained, capsys):
    """``tjax train --run-dir R --steps 6`` continues R with R's model and training settings
    (no flag repeated); an option given on top is checked as before; the settings of one
    invocation (``--json``, progress, a one-time data permission) are never inherited."""
    from transformers_jax.train_options import build_configs

    model_cfg, train_cfg = copy_of_trained
    run = train_cfg.run_dir
    got_model, got_train = build_configs(["--run-dir", run, "--steps", "6", "--json"])
    assert got_model == model_cfg
    assert got_train == train_cfg.replace(steps=6, json=True, progress=True)
    assert build_configs(["--run-dir", run, "--train.resume=false"])[0] == ModelConfig()
    assert cli.main(["train", "--run-dir", run, "--steps", "6", "--no-progress"]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert Checkpointer(run).latest_step() == 6
    with pytest.raises(CheckpointMismatchError, match="n_layers: checkpoint has 1, asked for 2"):
        train(*build_configs(["--run-dir", run, "--steps", "8", "--model.n_layers=2"]))


def test_missing_run_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no checkpoints in"):
        load_run(str(tmp_path / "nowhere"))
    assert cli.main(["sample", "--run", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoints in" in err and "Traceback" not in err


def test_load_run_restores_everything_and_greedy_is_stable(trained):
    model_cfg, train_cfg = trained
    model, params, tokenizer, config = load_run(train_cfg.run_dir)
    assert config == model_cfg and tokenizer.vocab_size == 262
    meta = Checkpointer(train_cfg.run_dir).read_meta()
    assert meta["step"] == 4 and isinstance(meta["data"]["iterator"], dict)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    prompt = [list(tokenizer.encode("def "))]
    first = generate(model, params, prompt, sampling, seed=0)
    again = generate(*load_run(train_cfg.run_dir)[:2], prompt, sampling, seed=99)
    assert first == again


def test_restore_onto_a_mesh_of_eight_devices(trained):
    _, train_cfg = trained
    _, params, _, _ = load_run(train_cfg.run_dir)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def shard_last_dim(leaf):  # split every array whose last dim divides by 8, else replicate
        if leaf.ndim and leaf.shape[-1] % 8 == 0:
            return NamedSharding(mesh, PartitionSpec(*[None] * (leaf.ndim - 1), "data"))
        return NamedSharding(mesh, PartitionSpec())

    _, sharded, _, _ = load_run(train_cfg.run_dir, shardings=shard_last_dim)
    kernel = sharded["layer_0"]["mlp"]["up"]["kernel"]  # [32, 128]
    assert kernel.sharding.spec == PartitionSpec(None, "data")
    assert kernel.addressable_shards[0].data.shape == (32, 16)
    jax.tree.map(np.testing.assert_array_equal, params, sharded)


@pytest.mark.slow
def test_cli_sample_streams_text(trained, capsys):
    run = trained[1].run_dir
    code = cli.main(["sample", "--run", run, "--prompt", "Hello", "--max-new-tokens", "12",
                     "--temperature", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("Hello") and len(out.encode()) >= 6
    code = cli.main(["sample", "--run", run, "--num-samples", "2", "--max-new-tokens", "5",
                     "--top-k", "5", "--top-p", "0.9"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("--- sample") == 2


def test_the_manifest_checks_contents_and_reads_the_older_sizes_only_form(tmp_path):
    """A file zeroed at its size is caught by its checksum, also once the step was verified
    (and remembered) intact; a manifest written before checksums still checks sizes."""
    from transformers_jax.errors import DamagedStepError
    from transformers_jax.runs.checkpoint import MANIFEST

    ckpt = Checkpointer(str(tmp_path), async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"w_N": np.arange(4096, dtype=np.float32) * step}, {"step": step})
    ckpt.wait()
    root = os.path.join(ckpt.directory, "2")
    paths = [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]
    for path in paths:  # old enough to be remembered as verified (see _RACY_NS)
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)
    assert ckpt.verify(1) == ckpt.verify(2) == []
    largest = max(paths, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.write(bytes(os.path.getsize(largest)))
    rel = os.path.relpath(largest, root)
    assert ckpt.verify(2) == [f"{rel} (the same size, other contents than saved: overwritten "
                              "or corrupted)"]
    with pytest.raises(DamagedStepError, match=f"{rel} .*; load an intact one with --step 1$"):
        ckpt.pick(2)
    said = []
    assert ckpt.pick(None, said.append) == 1 and said[0].startswith("the checkpoint of step 2")
    listed = json.load(open(os.path.join(root, MANIFEST)))["files"]
    with open(os.path.join(root, MANIFEST), "w") as f:  # sizes only, as before checksums
        json.dump({name: size for name, (size, _) in listed.items()}, f)
    assert ckpt.verify(2) == [] and ckpt.pick(None) == 2
    os.truncate(largest, 10)
    assert ckpt.verify(2) == [f"{rel} (10 bytes, written {listed[rel][0]})"]
    ckpt.close()
