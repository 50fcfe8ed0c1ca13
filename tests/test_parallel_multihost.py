"""Two real processes on this machine (CPU, gloo collectives, coordinator on 127.0.0.1) train as
one: the same losses and parameters as a single process on the same global batches, each
process supplying only its own rows; only process 0 writes logs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from multihost_worker import STEPS, make_batches, model_and_optimizer

from transformers_jax import ConfigError
from transformers_jax.parallel import initialize
from transformers_jax.train.step import init_state, make_train_step

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """The parent's environment minus the 8-fake-device XLA_FLAGS of conftest.py: each worker
    sets its own device count."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def launch(n: int, local_devices: int, mesh: str, out: Path, strategy: str = "jit") -> list:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(n), "--process-id", str(i),
             "--local-devices", str(local_devices), "--mesh", mesh, "--strategy", strategy,
             "--out", str(out / f"p{i}")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
        )
        for i in range(n)
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"worker failed:\n{stderr[-3000:]}"
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def single_process_reference():
    model, optimizer = model_and_optimizer()
    batches = make_batches()
    state = jax.jit(lambda: init_state(model, optimizer, 0, batches[0]))()
    step = jax.jit(make_train_step(model, optimizer))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    return losses, {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    # 2 processes x 2 CPU devices: a data=2 x fsdp=2 mesh, so parameters are sharded across
    # the two processes as well as within each.
    results = launch(2, 2, "data=2,fsdp=2", tmp_path)
    ref_losses, ref_params = single_process_reference()
    assert [r["process"] for r in results] == [0, 1]
    assert [r["rows"] for r in results] == [[0, 8], [8, 16]]  # each built only its own half
    for r in results:
        assert len(r["losses"]) == STEPS
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
    assert results[0]["checksums"] == results[1]["checksums"]  # both see the same global state
    params = np.load(tmp_path / "p0" / "params.npz")
    assert sorted(params.files) == sorted(ref_params)
    for name, want in ref_params.items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-5, err_msg=name)
    # Only process 0 writes logs.
    assert (tmp_path / "p0" / "metrics.jsonl").read_text().count("\n") == STEPS
    assert not (tmp_path / "p1").exists()


def test_initialize_wants_all_three_or_none():
    with pytest.raises(ConfigError, match="got coordinator_address but not num_processes, "
                                          "process_id: pass all three"):
        initialize("127.0.0.1:1234")
    with pytest.raises(ConfigError, match="0 <= process_id < num_processes"):
        initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ConfigError, match="expected 'host:port'"):
        initialize("localhost", 2, 0)
