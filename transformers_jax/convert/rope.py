"""Hugging Face ``rope_parameters`` / ``rope_scaling`` <-> our ``RopeConfig``.

Only rope types whose numbers our ``nn/positions.py`` reproduces are mapped (checked in
``tests/test_convert.py`` against the Hugging Face model's logits):

| HF ``rope_type`` | ours (``rope.scaling``) | notes |
|---|---|---|
| ``default`` | ``none`` | |
| ``linear`` | ``linear`` | |
| ``dynamic`` | ``dynamic_ntk`` | HF's reference length is ``max_position_embeddings`` |
| ``yarn`` | ``yarn`` | only the default attention factor ``0.1 ln(factor) + 1`` and ``truncate`` |
| ``llama3`` | ``llama3`` | |

Anything else (``longrope``, a YaRN ``attention_factor`` or ``mscale`` that changes the
attention factor, per-layer rope) is an error naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from transformers_jax.config import ConfigError, RopeConfig
from transformers_jax.convert.common import HFConfig, unsupported
from transformers_jax.convert.hf_files import ConversionError

HF_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def hf_rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """The flat rope dict as ``transformers`` resolves it: ``rope_scaling`` (old name) first,
    else ``rope_parameters``; ``rope_theta``/``partial_rotary_factor`` may sit at top level."""
    raw = hf.raw
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise unsupported(hf.model_type, "rope_parameters", params,
                          f"one rope per layer type ({nested}) is not expressible; ModelConfig "
                          "has one rope for all layers")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _yarn_attention_factor(factor: float, params: dict[str, Any]) -> float:
    """The cos/sin multiplier ``transformers`` uses for YaRN."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def rope_from_hf(hf: HFConfig, head_dim: int, *, partial_ok: bool = False) -> RopeConfig:
    """Our ``RopeConfig`` for a Hugging Face config, or a ``ConversionError`` naming the field."""
    params = hf_rope_parameters(hf)
    kind = params["rope_type"]
    field = "rope_parameters"
    if kind not in HF_TYPES:
        raise unsupported(hf.model_type, f"{field}.rope_type", kind,
                          f"supported rope types: {', '.join(HF_TYPES)}")
    fraction = float(params.get("partial_rotary_factor", 1.0))
    if fraction != 1.0 and not partial_ok:
        raise unsupported(hf.model_type, f"{field}.partial_rotary_factor", fraction,
                          f"the Hugging Face {hf.model_type} model rotates whole heads")
    base = float(params["rope_theta"])
    common: dict[str, Any] = dict(base=base, pairing="rotate_half", fraction=fraction)
    mpe = hf["max_position_embeddings"]
    original = hf.raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or mpe
    factor = params.get("factor")

    def make(**fields: Any) -> RopeConfig:
        try:
            return RopeConfig(**common, **fields)
        except ConfigError as err:
            raise unsupported(hf.model_type, field, params, str(err)) from err

    if kind == "default":
        return make()
    if factor is None and kind == "yarn":
        factor = mpe / original
    if factor is None:
        raise unsupported(hf.model_type, f"{field}.factor", None, f"rope_type={kind!r} needs it")
    factor = float(factor)
    if kind == "linear":
        return make() if factor == 1.0 else make(scaling="linear", factor=factor)
    if kind == "dynamic":  # transformers measures the length against max_position_embeddings
        return make(scaling="dynamic_ntk", factor=factor, original_max_len=int(mpe))
    if kind == "llama3":
        if factor == 1.0:
            return make()
        return make(scaling="llama3", factor=factor, original_max_len=int(original),
                    low_freq_factor=float(params["low_freq_factor"]),
                    high_freq_factor=float(params["high_freq_factor"]))
    # yarn
    attention_factor = _yarn_attention_factor(factor, params)
    ours = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    if abs(attention_factor - ours) > 1e-12:
        which = "attention_factor" if params.get("attention_factor") is not None else "mscale"
        raise unsupported(hf.model_type, f"{field}.{which}", params.get(which),
                          f"gives a YaRN attention factor of {attention_factor}; this project's "
                          f"YaRN uses 0.1 ln(factor) + 1 = {ours}")
    if params.get("truncate", True) is False:
        raise unsupported(hf.model_type, f"{field}.truncate", False,
                          "this project's YaRN rounds the correction range (truncate=True)")
    if factor == 1.0:
        return make()
    return make(scaling="yarn", factor=factor, original_max_len=int(original),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0))


def rope_to_hf(rope: RopeConfig, model_type: str) -> tuple[dict[str, Any], int | None]:
    """``(rope_parameters, max_position_embeddings or None)``: dynamic NTK pins the latter."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.base}
    if rope.fraction != 1.0:
        params["partial_rotary_factor"] = rope.fraction
    if rope.pairing != "rotate_half":
        raise ConversionError(
            f"cannot export to Hugging Face {model_type}: rope.pairing={rope.pairing!r}; it "
            "rotates halves (rotate_half)"
        )
    if rope.scaling == "none":
        return params, None
    if rope.scaling == "linear":
        return {**params, "rope_type": "linear", "factor": rope.factor}, None
    if rope.scaling == "dynamic_ntk":
        return {**params, "rope_type": "dynamic", "factor": rope.factor}, rope.original_max_len
    if rope.scaling == "yarn":
        return {**params, "rope_type": "yarn", "factor": rope.factor,
                "original_max_position_embeddings": rope.original_max_len,
                "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow}, None
    if rope.scaling == "llama3":
        return {**params, "rope_type": "llama3", "factor": rope.factor,
                "original_max_position_embeddings": rope.original_max_len,
                "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor}, None
    raise ConversionError(
        f"cannot export to Hugging Face {model_type}: rope.scaling={rope.scaling!r} has no "
        f"Hugging Face rope_type (mapped: none, linear, dynamic_ntk, yarn, llama3)"
    )
