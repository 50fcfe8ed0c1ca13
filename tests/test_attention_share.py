"""benchmarks/attention_share.py: the ``free`` stand-in reads q, k and v and passes gradients to
each, the bound's arithmetic, and one tiny run end to end in a process of its own (the script
registers ``free`` there, never in this test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from benchmark_modules import BENCHMARKS, ROOT, load_benchmark
from subprocess_env import single_device_env

SCRIPT = os.path.join(BENCHMARKS, "attention_share.py")


@pytest.fixture(scope="module")
def share():
    return load_benchmark("attention_share")


def test_free_attention_reads_every_input_and_passes_gradients(share):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, 4, 8)) for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped: 4 query heads over 2 key/value heads
    out = share.free_attention(q, k, v, bias=None, mask=None, scale=0.5, logit_softcap=None)
    want = jnp.repeat(v, 2, axis=2) + (q - jnp.repeat(k, 2, axis=2)) * 0.5
    np.testing.assert_allclose(out, want, rtol=1e-6)
    grads = jax.grad(lambda q, k, v: jnp.sum(share.free_attention(
        q, k, v, bias=None, mask=None, scale=None, logit_softcap=None)), argnums=(0, 1, 2))(
        q, k, v)
    # d/dq = 1/sqrt(8) everywhere; k and v each feed two query heads
    np.testing.assert_allclose(grads[0], np.full(q.shape, 8 ** -0.5), rtol=1e-6)
    np.testing.assert_allclose(grads[1], np.full(k.shape, -2 * 8 ** -0.5), rtol=1e-6)
    np.testing.assert_allclose(grads[2], np.full(v.shape, 2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="self-attention"):
        share.free_attention(q, k[:, :3], v[:, :3], bias=None, mask=None, scale=None,
                             logit_softcap=None)


def test_the_bound_is_the_median_speedup_times_the_ratio(share):
    # per round 2.0, 1.5 and 1.2: their median 1.5 (the ratio of the medians would be 2.0)
    out = share.summarise([200.0, 300.0, 120.0], [100.0, 200.0, 100.0], against=0.8)
    assert out["speedup_without_attention"]["values"] == pytest.approx([2.0, 1.5, 1.2])
    assert out["speedup_without_attention"]["median"] == pytest.approx(1.5)
    assert out["step_ms"]["with_attention"]["median"] == 200.0
    assert out["attention_share_of_step"] == pytest.approx(1 / 3)
    assert out["bound_with_free_attention"] == pytest.approx(1.2)
    assert "against" not in share.summarise([2.0], [1.0], against=None)


def test_a_tiny_run_end_to_end():
    env = {**single_device_env(), "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, SCRIPT, "--tiny", "--rounds", "2", "--steps", "1",
                          "--warmup", "0", "--against", "0.5"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    speedups = out["speedup_without_attention"]["values"]
    assert len(speedups) == 2 and all(s > 0 for s in speedups)
    median = out["speedup_without_attention"]["median"]
    assert out["bound_with_free_attention"] == pytest.approx(0.5 * median)
    assert out["model"]["attention"]["name"] != "free"  # the model's own attention is named
    assert set(out["compile_s"]) == {"with_attention", "attention_free"}
    assert all(s > 0 for s in out["compile_s"].values())
    # the stand-in was swapped in: its program lacks attention's two products, forward and
    # backward (the tiny model has one layer)
    dots = out["dot_generals"]
    assert dots["attention_free"] < dots["with_attention"]
    assert out["host_malloc"]


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--steps", "0"], ["--warmup", "-1"],
                                 ["--against", "0"], ["--packed"], ["--no-decode"]])
def test_bad_options_are_refused(share, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        share.main(["--tiny", *bad])
    assert exit_.value.code == 2
    assert bad[0] in capsys.readouterr().err
