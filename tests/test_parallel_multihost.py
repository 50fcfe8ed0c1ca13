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
from subprocess_env import single_device_env

from transformers_jax import ConfigError
from transformers_jax.learning.step import init_state, make_train_step
from transformers_jax.parallel import initialize

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """The parent's environment minus the 8-fake-device XLA_FLAGS of conftest.py: each worker
    sets its own device count."""
    env = single_device_env()
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


# TJAX_HEARTBEAT_TIMEOUT_S for the fault test: short, but long enough that a worker starved of
# CPU on a loaded 2-core machine is not declared dead before the kill.
HEARTBEAT_S = 12
EXIT_BOUND_S = HEARTBEAT_S + 30  # a survivor must be gone by then (heartbeat + shutdown slack)
# Every step is logged, so every step after a checkpoint is there to compare once replayed. A
# fault comes at step KILL_AT (logged) or just after: past the second checkpoint's save, which
# waits for the first one's commit, so a committed checkpoint is there to resume from; the
# runs' RUN_STEPS leave room for the steps a kill takes to land (a few; the waiter polls every
# 20 ms) and bound what a rerun trains again (a save costs as much as a few to tens of tiny
# steps; a step of two processes about 0.1 s of a loaded 2-core machine).
CHECKPOINT_EVERY = 4
KILL_AT = 2 * CHECKPOINT_EVERY + 1
RUN_STEPS = 28
# A SIGTERM stops the run only at the step the preemption service names for every process,
# which can take a second or more to agree on a loaded machine (seen: more than 11 steps
# later): its run's steps leave room for that; the steps after the stop never run.
SIGTERM_RUN_STEPS = 40


def train_command(run_dir: Path, port: int, process_id: int, steps: int) -> list[str]:
    """``tjax train`` (``python -m transformers_jax.cli train``: multihost_worker.py's
    ``tjax-train`` runs it with the peak FLOP/s given, not measured) without TensorBoard."""
    return [sys.executable, str(WORKER), "tjax-train", "--model.n_layers=1",
            "--model.d_model=32", "--model.n_heads=2", "--model.max_len=64",
            "--train.batch_size=4", "--train.seq_len=32", f"--steps={steps}",
            f"--train.checkpoint_every={CHECKPOINT_EVERY}", "--train.log_every=1",
            "--train.eval_every=1000", "--train.tensorboard=false",
            "--train.strategy=jit", f"--train.coordinator=127.0.0.1:{port}",
            "--train.num_processes=2", f"--train.process_id={process_id}",
            "--train.progress=false", "--run-dir", str(run_dir)]


def start_pair(run_dir: Path, port: int, steps: int, tmp: Path, tag: str) -> list:
    env = {**worker_env(), "TJAX_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
           "TJAX_SHUTDOWN_TIMEOUT_S": str(HEARTBEAT_S)}
    return [subprocess.Popen(train_command(run_dir, port, i, steps), env=env,
                             stdout=open(tmp / f"{tag}{i}.out", "w"),  # noqa: SIM115
                             stderr=open(tmp / f"{tag}{i}.err", "w"))  # noqa: SIM115
            for i in range(2)]


def worker_log(tmp: Path, tag: str, i: int) -> str:
    """Worker i's stderr and stdout for failure messages: from its first Python traceback when
    it has one (the cause; a coordination-service abort after it prints a long native stack that
    would push the cause out of a plain tail), else the tail."""
    parts = []
    for kind in ("err", "out"):
        text = (tmp / f"{tag}{i}.{kind}").read_text()
        start = text.find("Traceback (most recent call last)")
        parts.append(text[start:start + 4000] if start >= 0 else text[-2500:])
    return "\n".join(parts)


def train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(procs: list, run_dir: Path, tmp: Path, step: int, tag: str = "first",
                  skip: int = 0) -> None:
    """Until process 0 has logged training at ``step`` or later (after the first ``skip``
    records: an earlier run's); fails if a worker ends first."""
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        logged = [r["step"] for r in train_records(run_dir)[skip:] if r["kind"] == "train"]
        if logged and logged[-1] >= step:
            return
        ended = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert not ended, f"worker {ended} ended before step {step} (rc " + ", ".join(
            f"{procs[i].returncode}:\n{worker_log(tmp, tag, i)}" for i in ended)
        time.sleep(0.02)
    pytest.fail(f"the 2-process run never reached step {step}")


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_one_checkpoint(tmp_path):
    """A preemption notice reaches one host: both processes stop after the same step, having
    saved one checkpoint there together, and exit 0 (before, the other trained on into a
    collective that never completed)."""
    import signal

    from transformers_jax.runs.checkpoint import Checkpointer

    run_dir, steps = tmp_path / "run", SIGTERM_RUN_STEPS
    procs = start_pair(run_dir, free_port(), steps, tmp_path, "first")
    try:
        wait_for_step(procs, run_dir, tmp_path, KILL_AT)
        procs[1].send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=EXIT_BOUND_S + 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rcs == [0, 0], "\n".join(worker_log(tmp_path, "first", i) for i in range(2))
    stops = [r for r in train_records(run_dir) if r["kind"] == "stop"]
    assert len(stops) == 1 and KILL_AT <= stops[0]["step"] < steps, stops
    assert Checkpointer(str(run_dir)).latest_step() == stops[0]["step"]
    err = (tmp_path / "first0.err").read_text()
    assert f"saved step {stops[0]['step']}, stopping" in err, err[-2000:]


def kill_one(run_dir: Path, tmp: Path, victim: int, kill_at: int, tag: str) -> None:
    """Start the pair (resuming whatever ``run_dir`` holds), SIGKILL process ``victim`` once
    step ``kill_at`` is logged: the survivor exits non-zero within the heartbeat bound."""
    import time

    survivor, skip = 1 - victim, len(train_records(run_dir))
    procs = start_pair(run_dir, free_port(), RUN_STEPS, tmp, tag)
    try:
        wait_for_step(procs, run_dir, tmp, kill_at, tag, skip)  # past a committed checkpoint
        procs[victim].kill()
        killed_at = time.monotonic()
        rc = procs[survivor].wait(timeout=EXIT_BOUND_S + 60)
        survivor_s = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = (tmp / f"{tag}{survivor}.err").read_text()
    assert rc != 0, "the survivor must not report success"
    assert survivor_s < EXIT_BOUND_S, f"survivor took {survivor_s:.1f}s to exit"
    assert "another task died" in err or "heartbeat" in err, worker_log(tmp, tag, survivor)
    print(f"{tag}: process {victim} killed, survivor exited rc={rc} {survivor_s:.1f}s after")


def check_resumed(run_dir: Path) -> int:
    """The last run resumed from the last committed checkpoint of the run before it, which was
    killed before the end: the steps it replays have the losses logged before the kill. Returns
    the step it resumed at."""
    records = train_records(run_dir)
    resumes = [i for i, r in enumerate(records) if r["kind"] == "resume"]
    at = resumes[-1]
    killed = records[resumes[-2] if len(resumes) > 1 else 0:at]
    before = {r["step"]: r["loss"] for r in killed if r["kind"] == "train"}
    assert max(before) < RUN_STEPS
    start = records[at]["step"]
    # steps lost: none beyond the save
    assert CHECKPOINT_EVERY <= start <= max(before) and start % CHECKPOINT_EVERY == 0
    after = {r["step"]: r["loss"] for r in records[at:] if r["kind"] == "train"}
    replayed = sorted(s for s in before if s > start)
    assert replayed, "the kill came right at a checkpoint: nothing replayed to compare"
    np.testing.assert_allclose([after[s] for s in replayed], [before[s] for s in replayed],
                               rtol=1e-6)
    print(f"resumed at step {start}, replayed steps {replayed} with equal losses")
    return start


@pytest.mark.slow
def test_killed_worker_stops_the_other_and_rerun_resumes(tmp_path):
    """SIGKILL one of two `tjax train` processes mid-run, process 1 (a worker), then in the
    rerun that resumed process 0 (which hosts the coordination service and writes the
    checkpoints): each time the survivor exits non-zero within the heartbeat bound (no hang),
    and the same command run again resumes both processes from the last checkpoint: the steps
    replayed after it have the losses logged before the kill. (One run killed twice: the
    rerun after the first kill is the run the second kill interrupts.)"""
    from transformers_jax.runs.checkpoint import Checkpointer

    run_dir = tmp_path / "run"
    kill_one(run_dir, tmp_path, 1, KILL_AT, "first")
    committed = Checkpointer(str(run_dir)).latest_step()
    # the same command again, resumed; killed past a checkpoint it committed itself
    kill_one(run_dir, tmp_path, 0, committed + KILL_AT, "again")
    first_resume = check_resumed(run_dir)
    assert first_resume == committed

    procs = start_pair(run_dir, free_port(), RUN_STEPS, tmp_path, "last")
    try:
        for i, p in enumerate(procs):
            assert p.wait(timeout=TIMEOUT_S) == 0, worker_log(tmp_path, "last", i)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert check_resumed(run_dir) > first_resume
    records = train_records(run_dir)
    assert len([r for r in records if r["kind"] == "resume"]) == 2
    assert max(r["step"] for r in records if r["kind"] == "train") == RUN_STEPS
    assert records[-1]["kind"] == "final"


def test_fault_timeouts_are_checked_before_start_up(monkeypatch):
    monkeypatch.setenv("TJAX_HEARTBEAT_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="TJAX_HEARTBEAT_TIMEOUT_S='soon': expected a whole"):
        initialize("127.0.0.1:1234", 2, 0)
    monkeypatch.delenv("TJAX_HEARTBEAT_TIMEOUT_S")
    with pytest.raises(ConfigError, match="shutdown_timeout_s=0: must be positive"):
        initialize("127.0.0.1:1234", 2, 0, shutdown_timeout_s=0)
