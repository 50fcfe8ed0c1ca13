"""Model FLOPs per token and the device peak they are compared against (MFU)."""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig

# Dense bfloat16 peaks (FLOP/s per chip) of common accelerators, by jax device_kind substring.
KNOWN_PEAKS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6": 918e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "T4": 65e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True,
                    causal_half: bool = False) -> float:
    """Matmul FLOPs per token: 2 per multiply-add, forward; backward doubles it again (x3).

    Counts every weight matmul (including the output head, not the embedding lookup) and the
    two attention matmuls (scores and weighted sum) over the full ``seq_len`` keys, the
    convention of the PaLM paper's MFU (causal masking is not subtracted): per token and
    layer, attention adds ``2 * (2 * T * H * D)`` forward FLOPs (T = ``seq_len``, H heads of
    D dims). ``causal_half``: MaxText's convention, where a causal self-attention layer counts
    half of that, ``2 * T * H * D`` (``Family.forward_flops``). ``mfu`` uses the first,
    ``mfu_causal_half`` the second; they differ most at long context.
    """
    from transformers_jax.models import family_of

    forward = family_of(cfg).forward_flops(cfg, seq_len, causal_half=causal_half)
    return 3 * forward if training else forward


_PEAK_CACHE: dict[str, float] = {}


def measure_matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an ``n x n x n`` matmul on the default device (float32 accumulation)."""
    if dtype in _PEAK_CACHE:
        return _PEAK_CACHE[dtype]
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    _PEAK_CACHE[dtype] = 2 * n**3 / best
    return _PEAK_CACHE[dtype]


PEAK_ENV = "TJAX_PEAK_FLOPS"


def given_peak() -> float | None:
    """``TJAX_PEAK_FLOPS`` as a number, None when unset. ValueError: not a positive number."""
    given = os.environ.get(PEAK_ENV, "").strip()
    if not given:
        return None
    try:
        peak = float(given)
    except ValueError:
        peak = float("nan")
    if not math.isfinite(peak) or peak <= 0:
        raise ValueError(f"{PEAK_ENV}={given!r}: give the device's peak FLOP/s as a positive "
                         f"number (e.g. {PEAK_ENV}=1.97e14), or unset it to measure")
    return peak


def device_peak(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s, where it came from): the user's figure in ``TJAX_PEAK_FLOPS`` (per device,
    e.g. ``1.97e14``), else a known accelerator figure, else a measured matmul (about a second
    of a CPU's time in every process). ValueError: a ``TJAX_PEAK_FLOPS`` that is not a positive
    number."""
    given = given_peak()
    if given is not None:
        return given, PEAK_ENV
    device = jax.devices()[0]
    for name, peak in KNOWN_PEAKS.items():
        if name.lower() in device.device_kind.lower():
            return peak, f"datasheet bf16 peak of {device.device_kind}"
    return measure_matmul_peak(dtype), f"measured {dtype} matmul on {device.device_kind}"
