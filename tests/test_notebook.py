"""The Colab quickstart notebook runs end to end at a tiny size on CPU.

Needs ``nbclient``, ``nbformat`` and ``ipykernel`` (not in the ``test`` extra yet: the test skips,
saying so, without them).
"""

import os
import sys

import pytest
from subprocess_env import single_device_env

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat to execute the notebook")
nbclient = pytest.importorskip("nbclient", reason="pip install nbclient to execute the notebook")
pytest.importorskip("ipykernel", reason="pip install ipykernel: the notebook needs a kernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "quickstart.ipynb")


def test_notebook_is_committed_with_the_outputs_of_a_real_run():
    """What a reader sees on GitHub or Colab before running anything: every cell's outputs
    from one full-size run (not TINY), in order, without errors."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "TINY" in tagged[0].source
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), counts  # one run, top to bottom
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "")
                   for o in outputs)
    assert "backend:" in text and "The for statement" in text
    assert "'steps': 600" in text  # the full-size training cell, not TINY's 20 steps
    # the full spec's report, headed by the command that regenerates it
    assert "Command: `tjax sweep" in text
    assert "readme_positions.toml --out sweeps/quickstart" in text
    assert "| position=alibi | 147 | 301,056 |" in text  # 300k tokens a cell, not TINY's 4096
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the training curves and the sweep's plot


@pytest.mark.slow
def test_quickstart_notebook_runs_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TJAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # one CPU device, not the suite's fake eight; the suite's cheap compiles
    monkeypatch.setenv("XLA_FLAGS", single_device_env()["XLA_FLAGS"])
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    assert (tmp_path / "runs" / "quickstart" / "metrics.jsonl").exists()
    # the notebook writes only its run and its sweep into the folder it runs in (in a checkout,
    # experiments/): never a committed result
    assert sorted(os.listdir(tmp_path)) == ["runs", "sweeps"]
    assert os.listdir(tmp_path / "sweeps") == ["quickstart"]
    report = (tmp_path / "sweeps" / "quickstart" / "report.md").read_text()
    spec = os.path.join(ROOT, "experiments", "specs", "quickstart_tiny.toml")
    assert report.splitlines()[2] == (
        f"Command: `tjax sweep {spec} --out sweeps/quickstart --allow-code-change`")
    assert "2 of 2 cells finished" in report and "ALiBi degrades less than RoPE" in report
    text = "".join(out.get("text", "") + out.get("data", {}).get("text/markdown", "")
                   for cell in nb.cells for out in cell.get("outputs", []))
    assert "The for statement" in text  # the sample
    assert "'steps': 20" in text
    assert report.strip() in text  # the report is displayed as it is
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the training curves and the sweep's plot are displayed


def install_cell_namespace(tmp_path, monkeypatch, calls):
    """The Parameters and Install cells' code, run outside a checkout with the package missing
    and every subprocess recorded instead of run."""
    import importlib.util
    import subprocess

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    parameters, install = code[0], next(c for c in code if "REPO_URL" in c and "pip" in c)
    monkeypatch.chdir(tmp_path)  # not a checkout
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # not installed, and not on Colab
                        lambda name, *a: None if name in ("transformers_jax", "google.colab")
                        else real_find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(argv))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cell puts the source first
    import transformers_jax  # noqa: F401 (the cell's import then finds this one, not the fake)
    namespace: dict = {}
    exec(parameters, namespace)
    return namespace, install


def test_install_cell_outside_a_checkout_says_what_to_provide(tmp_path, monkeypatch):
    """Nothing to install from: the cell stops saying what to provide, not a git error."""
    monkeypatch.delenv("TJAX_REPO_URL", raising=False)
    calls: list = []
    namespace, install = install_cell_namespace(tmp_path, monkeypatch, calls)
    with pytest.raises(RuntimeError, match="put transformers-jax.zip .* or set REPO_URL"):
        exec(install, namespace)
    assert calls == []


def test_install_cell_installs_an_uploaded_source_archive(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.delenv("TJAX_REPO_URL", raising=False)
    with zipfile.ZipFile(tmp_path / "transformers-jax.zip", "w") as zf:
        zf.writestr("pyproject.toml", "[project]\nname = 'x'\n")
        zf.writestr("transformers_jax/__init__.py", "")
    calls: list = []
    namespace, install = install_cell_namespace(tmp_path, monkeypatch, calls)
    exec(install, namespace)
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e",
                      str(tmp_path / "transformers-jax")]]
    assert (tmp_path / "transformers-jax" / "pyproject.toml").exists()


def test_install_cell_clones_the_repository_given_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TJAX_REPO_URL", "https://example.org/me/transformers-jax.git")
    calls: list = []
    namespace, install = install_cell_namespace(tmp_path, monkeypatch, calls)
    exec(install, namespace)
    assert calls[0] == ["git", "clone", "--depth", "1",
                        "https://example.org/me/transformers-jax.git", "transformers-jax"]
    assert calls[1][-2:] == ["-e", "transformers-jax"]
