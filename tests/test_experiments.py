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


@pytest.mark.slow
def test_context_usage_tiny(results_dir):
    from experiments import context_usage

    context_usage.main(["--scale", "tiny"])
    out = json.loads((results_dir / "context_usage_tiny.json").read_text())
    assert set(out["results"]) == {"gpt", "lstm"}
    row = out["results"]["lstm"][0]
    assert {"truncate/4", "shuffle/16", "shuffle_spans/4", "random/16"} <= set(row)
    assert (results_dir / "context_usage_tiny.png").exists()


def test_perturbations_touch_only_the_far_context():
    import numpy as np

    from experiments.context_usage import perturb

    rng = np.random.default_rng(0)
    window = np.arange(100)
    for kind in ("shuffle", "shuffle_spans", "random"):
        out = perturb(window, 60, kind, rng, vocab=1000)
        assert len(out) == 100 and np.array_equal(out[60:], window[60:])
        assert not np.array_equal(out[:60], window[:60])
    spans = perturb(window, 60, "shuffle_spans", rng, vocab=1000)
    for start in range(0, 60, 20):  # each span keeps its own tokens
        assert sorted(spans[start : start + 20]) == list(range(start, start + 20))
    assert np.array_equal(perturb(window, 60, "truncate", rng, 1000), window[60:])
