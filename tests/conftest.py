"""Test set-up: 8 fake CPU devices (before JAX is imported), float32 everywhere, cheap XLA
compiles and one persistent compilation cache for the whole run. A subprocess takes its
environment from ``subprocess_env.single_device_env``.

The suite builds the same tiny models again and again (every seed of an experiment, every
`tjax` subprocess); XLA compiles dominate its time on 2 cores. The cache lives in a fresh
temporary folder shared by the pytest-xdist workers and their subprocesses (through the
environment) and is removed at the end, so a run never reads another run's executables. Set
JAX_COMPILATION_CACHE_DIR yourself to keep it, or TJAX_TEST_NO_XLA_CACHE=1 to compile everything.
"""

import importlib.util
import os
import shutil
import sys
import tempfile

from subprocess_env import CHEAP_KERNEL_FLAGS

# Cheap compiles: the suite compiles thousands of tiny programs and runs each briefly, so LLVM's
# optimisation of XLA's generated loops costs more than it saves (a test 72 -> 56 s, a training
# test no slower; matmuls are library calls, unaffected). Speed is measured by the benchmarks,
# never here; TJAX_TEST_XLA_OPT=1 keeps XLA's default.
os.environ.setdefault("XLA_FLAGS", "")
FLAGS = os.environ["XLA_FLAGS"]
if not os.environ.get("TJAX_TEST_XLA_OPT") and "backend_optimization" not in FLAGS:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's newer fusion emitters compile a tiny program about 2.5x slower than the classic ones
# (a 16-tile chunked gradient 2.3 -> 0.9 s of CPU, the same numbers to 1e-8); the suite
# compiles thousands. TJAX_TEST_XLA_OPT=1 keeps XLA's defaults for both.
if not os.environ.get("TJAX_TEST_XLA_OPT") and "fusion_emitters" not in FLAGS:
    os.environ["XLA_FLAGS"] += " " + " ".join(CHEAP_KERNEL_FLAGS)
# what a subprocess (one device: `tjax`, a multi-host worker) gets; set before the device count
os.environ.setdefault("TJAX_TEST_CHILD_XLA_FLAGS", os.environ["XLA_FLAGS"].strip())
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# set in the main pytest process, before xdist starts its workers: they inherit the folder
OWN_CACHE = (not os.environ.get("TJAX_TEST_NO_XLA_CACHE")
             and "JAX_COMPILATION_CACHE_DIR" not in os.environ)
if OWN_CACHE:
    CACHE_DIR = tempfile.mkdtemp(prefix="tjax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
    # tiny programs too: one loads back no faster than it compiles, but the same ones recur
    # across the two workers and the `tjax` processes (kept to those over 0.5 s, a whole run
    # took 1,858 s of CPU against 1,725)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# MFU's peak given, not timed: a 2048^3 matmul costs every `tjax train` process about a second
# of CPU (tests of the figure itself unset it; transcripts print what users see)
os.environ.setdefault("TJAX_PEAK_FLOPS", "1e11")

# tjax's own default cache (~/.cache/transformers_jax/xla) stays out of the suite: with the
# folder above set, JAX's setting is used; with TJAX_TEST_NO_XLA_CACHE=1, none
os.environ.setdefault("TJAX_COMPILE_CACHE", "off")

import jax  # noqa: E402
import profiles  # noqa: E402,F401  (the hypothesis profiles: TJAX_TEST_PROFILE=ci|thorough)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Entries a test asks for (TJAX_TEST_EXTRA_ENTRIES: module files, os.pathsep-separated) are
# registered before the tests are collected, so every property test parametrised over a
# registry covers them: tests/test_recipes.py follows the README's recipes this way.
for _path in filter(None, os.environ.get("TJAX_TEST_EXTRA_ENTRIES", "").split(os.pathsep)):
    _spec = importlib.util.spec_from_file_location(os.path.basename(_path)[:-3], _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module
    _spec.loader.exec_module(_module)


# The costliest files first (measured: docs/testing.md). pytest-xdist hands whole files to its
# workers (--dist loadfile) in collection order, so a long file collected late keeps one worker
# busy while the other has nothing left; first, they overlap with everything else.
COSTLY_FIRST = ("test_encdec.py", "test_plan.py", "test_parallel_context.py",
                "test_cli_journeys.py", "test_bert.py", "test_transcripts.py", "test_kvcache.py",
                "test_parallel.py", "test_attention.py", "test_side_by_side.py",
                "test_parallel_multihost.py", "test_recipes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(COSTLY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


def pytest_unconfigure(config):
    if OWN_CACHE:  # only the process that made the folder (the main one) removes it
        shutil.rmtree(CACHE_DIR, ignore_errors=True)


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """The experiments write their results into a fresh folder."""
    import experiments.common as common

    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


@pytest.fixture
def assert_replots(results_dir, monkeypatch):
    """``check(module, name, argv)``: ``module.main([*argv, "--replot"])`` trains nothing and
    rebuilds ``name``'s table and plot from its JSON, the JSON and the table unchanged."""

    def check(module, name: str, argv=()) -> None:
        paths = {ext: results_dir / f"{name}.{ext}" for ext in ("json", "md", "png")}
        before = {ext: paths[ext].read_text() for ext in ("json", "md")}
        paths["png"].unlink()
        monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail("--replot trained"))
        module.main([*argv, "--replot"])
        assert {ext: paths[ext].read_text() for ext in ("json", "md")} == before
        assert paths["png"].stat().st_size > 10_000
        with pytest.raises(SystemExit):  # no results JSON at that scale: a parser error
            module.main(["--scale", "large", "--replot"])

    return check


@pytest.fixture
def split_cache(tmp_path, monkeypatch):
    """The experiments' held-out splits are cached in a fresh folder."""
    monkeypatch.setenv("TJAX_SPLIT_CACHE", str(tmp_path / "splits"))
