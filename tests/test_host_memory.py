"""host_memory: the malloc tunables tjax runs with, and that they stop XLA:CPU's per-call faults."""

import os
import subprocess
import sys
import textwrap

import pytest

from transformers_jax import host_memory
from transformers_jax.host_memory import TUNABLES, environment_keeping_freed_memory, status

glibc_only = pytest.mark.skipif(status({}) == "not glibc", reason="glibc malloc tunables")

# A jitted function whose [8192, 2048] float32 intermediate (64 MiB) lives in XLA's temporary
# buffer; prints the minor page faults per call after a warm-up call.
FAULTS_PER_CALL = textwrap.dedent("""
    import resource
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
    x, w = jnp.ones((8192, 64)), jnp.ones((64, 2048)) / 64
    assert f.lower(x, w).compile().memory_analysis().temp_size_in_bytes >= 64 << 20
    f(x, w).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        f(x, w).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6)
""")


def clean_environment() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", host_memory.OPT_OUT, host_memory._RELAUNCHED)}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def run_python(code: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@glibc_only
def test_status_reads_the_tunables_and_the_opt_out():
    assert status({}) == "system default"
    assert status({"GLIBC_TUNABLES": ":".join(TUNABLES)}) == "keeps freed memory"
    assert status({"GLIBC_TUNABLES": TUNABLES[0]}) == "system default"  # all three or nothing
    assert status({host_memory.OPT_OUT: "system"}).startswith("system default (")


def test_environment_keeps_other_tunables_and_replaces_ours():
    env = environment_keeping_freed_memory(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.pthread.rseq=0", "HOME": "/h"})
    assert env["HOME"] == "/h"
    parts = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.pthread.rseq=0" in parts and "glibc.malloc.arena_max=4" not in parts
    assert all(t in parts for t in TUNABLES)
    assert env == environment_keeping_freed_memory(env)  # idempotent


@glibc_only
def test_tunables_stop_the_page_faults_of_xla_temporaries():
    default = float(run_python(FAULTS_PER_CALL, clean_environment()))
    kept = float(run_python(FAULTS_PER_CALL, environment_keeping_freed_memory(clean_environment())))
    assert default > 8_000  # 64 MiB of fresh 4 KiB pages, every call
    assert kept < default / 4


@glibc_only
def test_relaunch_re_executes_once_with_the_tunables():
    code = ("from transformers_jax.host_memory import relaunch_keeping_freed_memory, status\n"
            "print(status())\n"
            "print('returned', relaunch_keeping_freed_memory())\n")
    out = run_python(code, clean_environment()).split("\n")
    assert out[:3] == ["system default", "keeps freed memory", "returned keeps freed memory"]
    opted_out = run_python(code, {**clean_environment(), host_memory.OPT_OUT: "system"})
    assert opted_out.count("\n") == 2 and "returned system default (" in opted_out
