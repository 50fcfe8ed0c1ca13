"""The CPU backend's malloc setting (``backends.cpu_malloc``): the glibc tunables tjax runs
with, that they cut XLA:CPU's per-call faults, and ``backends.prepare_host``, which sets them
where XLA:CPU computes."""

import os
import subprocess
import sys
import textwrap

import pytest

from transformers_jax import backends
from transformers_jax.backends import cpu_malloc as host_memory
from transformers_jax.backends.cpu_malloc import (
    REUSE_TUNABLES,
    TUNABLES,
    environment_with_tunables,
    huge_pages_mode,
    status,
)

glibc_only = pytest.mark.skipif(status({}) == "not glibc", reason="glibc malloc tunables")
# where the relaunch acts: glibc >= 2.35 (malloc.hugetlb) and THP in madvise mode (under
# "always" the kernel gives glibc's big blocks huge pages already)
acts_here = pytest.mark.skipif(status({}, thp_mode="madvise") == "not glibc"
                               or host_memory.glibc_version() < (2, 35)
                               or huge_pages_mode() != "madvise",
                               reason="the tunable acts only with glibc >= 2.35 and THP madvise")

# A jitted function whose [8192, 2048] float32 intermediate (64 MiB) lives in XLA's temporary
# buffer; prints the minor page faults per call after three warm-up calls: the fewest of four
# windows of 6 calls (the reuse mode's heap still grows now and then when one call's buffers
# overlap the next's; a buffer mapped anew faults in every window).
FAULTS_PER_CALL = textwrap.dedent("""
    import resource
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
    x, w = jnp.ones((8192, 64)), jnp.ones((64, 2048)) / 64
    assert f.lower(x, w).compile().memory_analysis().temp_size_in_bytes >= 64 << 20
    for _ in range(3):
        f(x, w).block_until_ready()
    windows = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(6):
            f(x, w).block_until_ready()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6)
    print(min(windows))
""")


def clean_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in host_memory.VARIABLES}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def run_python(code: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@glibc_only
def test_status_reads_the_tunables_the_opt_out_and_the_kernel():
    madvise = {"thp_mode": "madvise"}
    if host_memory.glibc_version() >= (2, 35):
        assert status({}, **madvise) == "system default"  # what the relaunch would change
        assert status({}, thp_mode="always") == "system default (transparent huge pages: always)"
        assert status({}, thp_mode="never") == "system default (transparent huge pages: never)"
    assert status({"GLIBC_TUNABLES": ":".join(TUNABLES)}, **madvise) == "huge pages"
    assert status({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.hugetlb=0"},
                  **madvise) == "user setting (glibc.malloc.hugetlb=0)"  # left as it is
    assert status({host_memory.OPT_OUT: "system"}, **madvise).startswith("system default (")
    with pytest.raises(ValueError, match="TJAX_HOST_MALLOC='off': set it to 'system'"):
        status({host_memory.OPT_OUT: "off"}, **madvise)
    # reuse: its arena settings act whatever the kernel's huge page mode
    reuse = {host_memory.OPT_OUT: "reuse"}
    for thp in ("madvise", "always", "never"):
        assert status(reuse, thp_mode=thp) == "system default"  # the relaunch would act
    # the huge-page tunable inherited from a default-mode parent: the relaunch completes it
    assert status({**reuse, "GLIBC_TUNABLES": ":".join(TUNABLES)}, **madvise) == "system default"
    # one of ours at another value is the user's: left alone
    assert status({**reuse, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, **madvise) \
        == "user setting (glibc.malloc.arena_max=4)"
    every = {"GLIBC_TUNABLES": ":".join(TUNABLES + REUSE_TUNABLES)}
    assert status({**reuse, **every}, **madvise) == "freed blocks reused (TJAX_HOST_MALLOC=reuse)"
    # the label says what the tunables do, whichever mode asked for them (a script sets them)
    assert status(every, **madvise) == "freed blocks reused (TJAX_HOST_MALLOC=reuse)"
    assert status({host_memory.OPT_OUT: "system", "GLIBC_TUNABLES": ":".join(TUNABLES)},
                  **madvise) == "huge pages"  # set by hand: glibc applies them all the same


def test_environment_keeps_other_tunables_and_replaces_ours():
    env = environment_with_tunables(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=2:glibc.pthread.rseq=0", "HOME": "/h"})
    assert env["HOME"] == "/h"
    parts = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.pthread.rseq=0" in parts and "glibc.malloc.hugetlb=2" not in parts
    assert all(t in parts for t in TUNABLES)
    assert env == environment_with_tunables(env)  # idempotent
    reuse = environment_with_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4",
                                       host_memory.OPT_OUT: "reuse"})
    assert reuse["GLIBC_TUNABLES"].split(":") == [*TUNABLES, *REUSE_TUNABLES]
    # the default mode leaves a user's arena setting alone, in the environment and the status
    own = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    assert environment_with_tunables(own)["GLIBC_TUNABLES"].split(":") == [
        "glibc.malloc.arena_max=4", *TUNABLES]
    assert not status(own, thp_mode="madvise").startswith("user setting")
    assert "GLIBC_TUNABLES" not in environment_with_tunables({host_memory.OPT_OUT: "system"})


@pytest.mark.slow
@acts_here
def test_tunables_cut_the_page_faults_of_xla_temporaries():
    default = float(run_python(FAULTS_PER_CALL, clean_environment()))
    kept = float(run_python(FAULTS_PER_CALL, environment_with_tunables(clean_environment())))
    assert default > 8_000  # 64 MiB of fresh 4 KiB pages, every call
    assert kept < default / 4


@pytest.mark.slow
@glibc_only
def test_reuse_keeps_the_freed_buffer_whatever_the_huge_page_mode():
    reuse_env = environment_with_tunables({**clean_environment(), host_memory.OPT_OUT: "reuse"})
    reused = float(run_python(FAULTS_PER_CALL, reuse_env))
    assert reused < 16  # mapped anew, the 64 MiB would fault at least 32 times (2 MiB pages)


@acts_here
def test_relaunch_re_executes_once_with_the_tunables():
    code = ("from transformers_jax.backends import prepare_host\n"
            "from transformers_jax.backends.cpu_malloc import status\n"
            "print(status())\n"
            "print('returned', prepare_host())\n")
    out = run_python(code, clean_environment()).split("\n")
    assert out[:3] == ["system default", "huge pages", "returned huge pages"]
    opted_out = run_python(code, {**clean_environment(), host_memory.OPT_OUT: "system"})
    assert opted_out.count("\n") == 2 and "returned system default (" in opted_out
    reuse = run_python(code, {**clean_environment(), host_memory.OPT_OUT: "reuse"}).split("\n")
    assert reuse[:3] == ["system default", "freed blocks reused (TJAX_HOST_MALLOC=reuse)",
                         "returned freed blocks reused (TJAX_HOST_MALLOC=reuse)"]


def test_tjax_re_executes_before_importing_jax():
    # the package's names load lazily: the command line and the malloc switch import no JAX,
    # so the re-executed process is the only one that pays for JAX's start-up
    code = ("import sys\nimport transformers_jax.cli, transformers_jax.backends.cpu_malloc\n"
            "from transformers_jax.backends import cpu_malloc, prepare_host\n"
            "print(sorted(m for m in ('jax', 'flax', 'numpy') if m in sys.modules))\n"
            "import transformers_jax\nprint(transformers_jax.ModelConfig.__module__)\n")
    assert run_python(code, clean_environment()).split("\n")[:2] == [
        "[]", "transformers_jax.config"]


def test_tjax_refuses_an_unknown_opt_out_value():
    env = {**clean_environment(), host_memory.OPT_OUT: "off"}
    done = subprocess.run([sys.executable, "-m", "transformers_jax.cli", "train", "--steps", "1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tjax: error: TJAX_HOST_MALLOC='off': set it to 'system'" in done.stderr


def test_prepare_host_leaves_a_process_that_computes_elsewhere_alone(monkeypatch):
    """The malloc setting is the CPU backend's: where ``JAX_PLATFORMS`` names another platform
    first, ``prepare_host`` neither re-executes the process nor sets anything."""
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert backends.prepare_host() == "system default (JAX_PLATFORMS=tpu,cpu)"

