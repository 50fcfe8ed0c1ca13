"""Hugging Face ``rope_parameters`` / ``rope_scaling`` <-> our ``Rope`` position scheme.

Each of our RoPE scalings (``nn/positions/rope_scaling.py``) names its Hugging Face
``rope_type`` and maps its fields both ways; a scaling without one (``ntk``) does not export.
Checked in ``tests/test_convert.py`` against the Hugging Face model's logits. What a rule
cannot express (a YaRN ``attention_factor`` or ``mscale`` that changes the attention factor,
say) it raises as ``UnmappableHF``; an unknown ``rope_type`` (``longrope``) or per-layer rope
is an error naming the field here.
"""

from __future__ import annotations

from typing import Any

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.convert.common import HFConfig, unsupported
from transformers_jax.convert.hf_files import ConversionError
from transformers_jax.nn.positions.rope_scaling import Extension, UnmappableHF
from transformers_jax.registry import ROPE_SCALINGS


def _scalings_by_hf_type() -> dict:
    return {cls.hf_rope_type: cls for _, cls in ROPE_SCALINGS.items() if cls.hf_rope_type}


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


def rope_from_hf(hf: HFConfig, head_dim: int, *, partial_ok: bool = False) -> dict[str, Any]:
    """Our ``position`` (a rope switch as JSON) for a Hugging Face config, or a
    ``ConversionError`` naming the field."""
    params = hf_rope_parameters(hf)
    kind = params["rope_type"]
    field = "rope_parameters"
    by_type = _scalings_by_hf_type()
    if kind not in by_type:
        raise unsupported(hf.model_type, f"{field}.rope_type", kind,
                          f"supported rope types: {', '.join(sorted(by_type))}")
    fraction = float(params.get("partial_rotary_factor", 1.0))
    if fraction != 1.0 and not partial_ok:
        raise unsupported(hf.model_type, f"{field}.partial_rotary_factor", fraction,
                          f"the Hugging Face {hf.model_type} model rotates whole heads")
    rope: dict[str, Any] = dict(name="rope", base=float(params["rope_theta"]),
                                pairing="rotate_half", fraction=fraction)
    mpe = hf["max_position_embeddings"]
    original = hf.raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or mpe
    try:
        scaling = by_type[kind].from_hf(params, int(mpe), int(original))
    except UnmappableHF as err:
        raise unsupported(hf.model_type, f"{field}.{err.field}", err.value, err.why) from err
    if isinstance(scaling, Extension):  # factor 1 came back as plain RoPE
        rope["scaling"] = scaling.to_dict()
    try:  # check it as a model would
        ModelConfig(head_dim=head_dim, n_heads=1, d_model=head_dim, position=rope)
    except ConfigError as err:
        raise unsupported(hf.model_type, field, params, str(err)) from err
    return rope


def rope_to_hf(rope: Any, model_type: str) -> tuple[dict[str, Any], int | None]:
    """``(rope_parameters, max_position_embeddings or None)``: dynamic NTK pins the latter."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.base}
    if rope.fraction != 1.0:
        params["partial_rotary_factor"] = rope.fraction
    if rope.pairing != "rotate_half":
        raise ConversionError(
            f"cannot export to Hugging Face {model_type}: position.pairing={rope.pairing!r}; it "
            "rotates halves (rotate_half)"
        )
    scaling = rope.scaling
    if scaling.hf_rope_type is None:
        mapped = ", ".join(name for name, cls in ROPE_SCALINGS.items() if cls.hf_rope_type)
        raise ConversionError(
            f"cannot export to Hugging Face {model_type}: position.scaling={scaling.name!r} has "
            f"no Hugging Face rope_type (mapped: {mapped})"
        )
    try:
        extra, pinned_len = scaling.hf_parameters()
    except ValueError as err:
        raise ConversionError(f"cannot export to Hugging Face {model_type}: {err}") from err
    params["rope_type"] = scaling.hf_rope_type
    return {**params, **extra}, pinned_len
