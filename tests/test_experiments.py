"""Each experiment runs end to end at a tiny scale and writes its JSON, table and plot."""

import json
import math

import pytest

import experiments.common as common


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_length_extrapolation_tiny(results_dir):
    from experiments import length_extrapolation

    length_extrapolation.main(["--scale", "tiny", "--seeds", "1", "--schemes", "alibi,learned"])
    out = json.loads((results_dir / "length_extrapolation_tiny.json").read_text())
    assert out["lengths"] == [16, 32]
    learned, alibi = out["results"]["learned"][0], out["results"]["alibi"][0]
    assert math.isnan(learned["flat"]["32"]) and not math.isnan(alibi["flat"]["32"])
    assert 0 < alibi["sliding"]["16"] < 10
    table = (results_dir / "length_extrapolation_tiny.md").read_text()
    assert table.startswith("Command: `python -m") and "n/a (beyond table)" in table
    assert (results_dir / "length_extrapolation_tiny.png").stat().st_size > 10_000


@pytest.mark.slow
def test_rope_extension_tiny(results_dir):
    from experiments import rope_extension

    rope_extension.main(["--scale", "tiny", "--seeds", "1", "--scalings", "none,yarn"])
    out = json.loads((results_dir / "rope_extension_tiny.json").read_text())
    assert set(out["results"]) == {"none", "yarn"}
    zero_shot = {k: v[0]["zero_shot"] for k, v in out["results"].items()}
    assert zero_shot["none"] != zero_shot["yarn"]  # the scaling changes the numbers
    assert (results_dir / "rope_extension_tiny.png").exists()
