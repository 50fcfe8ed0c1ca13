"""The persistent compilation cache of the tjax commands (``transformers_jax.compile_cache``):
which folder is chosen, and that a second process loads what the first one compiled."""

import os
import subprocess
import sys

import pytest
from subprocess_env import single_device_env

from transformers_jax.compile_cache import ENV, chosen_dir, default_dir, use_compile_cache


def test_the_first_setting_found_wins():
    assert default_dir({"HOME": "/home/u"}) == "/home/u/.cache/transformers_jax/xla"
    assert default_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}) == \
        "/xdg/transformers_jax/xla"
    # nothing set: tjax's default folder
    assert chosen_dir(None, {"XDG_CACHE_HOME": "/xdg"}, None) == "/xdg/transformers_jax/xla"
    # JAX's own setting is kept
    assert chosen_dir(None, {"XDG_CACHE_HOME": "/xdg"}, "/jax") == "/jax"
    # TJAX_COMPILE_CACHE comes first; off (any case, any spacing) means none of ours
    assert chosen_dir(None, {ENV: "/mine"}, "/jax") == "/mine"
    for off in ("off", " OFF ", "none", "0", ""):
        assert chosen_dir(None, {ENV: off}, None) is None
    # an explicit folder (tjax bench --compile-cache) beats everything; local folders come
    # back absolute, remote ones as given
    assert chosen_dir("/bench", {ENV: "/mine"}, "/jax") == "/bench"
    assert chosen_dir("~/c", {}, None) == os.path.join(os.path.expanduser("~"), "c")
    assert chosen_dir(" rel/c ", {}, None) == os.path.join(os.getcwd(), "rel", "c")
    assert chosen_dir("gs://bucket/xla", {}, None) == "gs://bucket/xla"


def test_a_folder_of_ours_is_bounded_and_an_open_cache_is_kept(tmp_path, monkeypatch, capsys):
    """In a folder tjax chose, JAX evicts beyond MAX_BYTES; once JAX has opened its cache in
    this process another folder is refused with a warning, the open one reported."""
    import jax

    import transformers_jax.compile_cache as compile_cache

    saved = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_compilation_cache_max_size")}
    try:
        monkeypatch.setattr(compile_cache, "_cache_opened", lambda: False)
        jax.config.update("jax_compilation_cache_max_size", -1)
        folder = tmp_path / "xla"
        assert use_compile_cache(str(folder)) == str(folder) and folder.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(folder)
        assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES

        monkeypatch.setattr(compile_cache, "_cache_opened", lambda: True)
        assert use_compile_cache(str(tmp_path / "other")) == str(folder)
        assert jax.config.jax_compilation_cache_dir == str(folder)
        err = capsys.readouterr().err
        assert "already open at" in err and str(tmp_path / "other") in err
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def test_a_folder_that_cannot_be_made_warns_and_turns_nothing_on(tmp_path, monkeypatch,
                                                                  capsys):
    import jax

    import transformers_jax.compile_cache as compile_cache

    monkeypatch.setattr(compile_cache, "_cache_opened", lambda: False)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(ENV, str(blocker / "cache"))  # a folder under a file
    before = jax.config.jax_compilation_cache_dir
    assert use_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir == before
    err = capsys.readouterr().err
    assert "cannot use" in err and str(blocker / "cache") in err and ENV in err


def test_off_leaves_jaxs_own_setting_alone(monkeypatch):
    import jax

    monkeypatch.setenv(ENV, "off")
    before = jax.config.jax_compilation_cache_dir
    assert use_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir == before


def _entries(folder) -> set[str]:
    return {name for name in os.listdir(folder) if not name.startswith(".")}


@pytest.mark.slow
def test_a_second_tjax_train_loads_the_executables_the_first_compiled(tmp_path):
    """Two `tjax train` processes with the same command: the first writes the cache folder
    (TJAX_COMPILE_CACHE), the second loads its train step from there (JAX's debug log says
    so) and adds nothing."""
    cache = tmp_path / "cache"
    env = single_device_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # conftest's folder for the suite
    env.update({ENV: str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    argv = [sys.executable, "-m", "transformers_jax.cli", "train", "--data", str(corpus),
            "--steps", "2", "--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2",
            "--train.batch_size=2", "--train.seq_len=16", "--train.eval_batches=1",
            "--no-progress"]
    first = subprocess.run([*argv, "--run-dir", str(tmp_path / "a")], env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    written = _entries(cache)
    assert any("train_step" in name for name in written), sorted(written)
    env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler"  # logs each persistent cache hit
    second = subprocess.run([*argv, "--run-dir", str(tmp_path / "b")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Persistent compilation cache hit for 'jit_train_step'" in second.stderr
    assert _entries(cache) == written  # every program was found: nothing new written
