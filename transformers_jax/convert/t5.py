"""T5 (``T5ForConditionalGeneration``) <-> our ``encdec`` family.

T5 is our encoder-decoder with ``position=t5`` (one bucketed bias table per stack, stored in
block 0 of each, shared by its layers; the decoder's is causal), pre-RMSNorm (T5's LayerNorm
has no mean and no bias), no biases anywhere, no attention scaling (``attention_scale=1``),
one shared token embedding, and an ``ACT`` or ``gated-ACT`` MLP (``relu``; ``gated-silu``, our
``swiglu``; ``gated-gelu``, T5 v1.1 and Flan-T5, our ``geglu``: any MLP whose registry entry
names its Hugging Face activation). Cross-attention has no position term, as ours.

The head: ``transformers`` multiplies the decoder output by ``d_model**-0.5`` before the
projection when ``scale_decoder_outputs`` (original T5, tied embeddings). ModelConfig has no
such factor, so it is folded into the decoder's final RMSNorm scale, the only thing between
that multiplication and the head: the same function, but the stored scale is rounded once
(an export divides it back, exact to one float32 ulp; exactly when ``d_model`` is a power of
4). The head is separate exactly when the checkpoint holds a ``lm_head.weight`` that differs
from ``shared.weight`` (as ``transformers`` 5 decides), whatever ``tie_word_embeddings`` says.

Not expressible: a decoder depth different from the encoder's (``num_decoder_layers``; needs a
ModelConfig field).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from transformers_jax.config import ModelConfig
from transformers_jax.convert.common import (
    ARCHITECTURES,
    Architecture,
    HFConfig,
    Rule,
    build_config,
    copy,
    linear,
    mlp_from_hf,
    mlp_to_hf,
    pinned,
    require_layout,
    require_ours,
    require_plain_attention,
    unsupported,
)

DEFAULTS = {
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_decoder_layers": None,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "is_encoder_decoder": True,
    "tie_word_embeddings": True,
}
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "num_heads",
           "num_hidden_layers": "num_layers", "head_dim": "d_kv"}
LAYOUT = {  # what T5 fixes (see common.Layout)
    "family": ("encdec", "T5 is an encoder-decoder"),
    "mask": ("causal", "T5's decoder attends causally"),
    "position": ("t5", "T5 uses its bucketed relative bias"),
    "norm": ("rmsnorm", "T5's LayerNorm is an RMSNorm"),
    "norm_position": ("pre", "T5 normalises before each block"),
    "use_bias": (False, "T5 has no biases"),
}


def scales_decoder_output(hf_config: Mapping) -> bool:
    """Whether ``transformers`` multiplies the decoder output by ``d_model**-0.5``."""
    if hf_config.get("scale_decoder_outputs") is not None:
        return bool(hf_config["scale_decoder_outputs"])
    return hf_config.get("tie_word_embeddings") is not False


# transformers runs T5's "gated-gelu" (T5 v1.1, Flan-T5) with the tanh GELU: its name is gelu_new.
GATED_GELU, GATED_GELU_ACT = "gated-gelu", "gelu_new"


def _mlp(hf: HFConfig) -> str:
    proj = hf["feed_forward_proj"]
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise unsupported("t5", "feed_forward_proj", proj, "expected ACT or gated-ACT")
    act = GATED_GELU_ACT if proj == GATED_GELU else parts[-1]
    return mlp_from_hf("t5", "feed_forward_proj", act, gated=len(parts) == 2, value=proj)


def config_from_hf(raw: dict) -> ModelConfig:
    raw = {ALIASES.get(k, k): v for k, v in raw.items()}
    hf = HFConfig(raw, DEFAULTS, "t5")
    hf.require("is_encoder_decoder", True, "only the encoder-decoder T5 maps to encdec")
    layers = hf["num_layers"]
    decoder_layers = hf.get("num_decoder_layers", layers)
    return build_config(
        "t5",
        **pinned(LAYOUT, position={"num_buckets": hf["relative_attention_num_buckets"],
                                   "max_distance": hf["relative_attention_max_distance"]},
                 norm={"eps": float(hf["layer_norm_epsilon"])}),
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        n_layers=layers,
        n_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        d_ff=hf["d_ff"],
        mlp=_mlp(hf),
        # what the config says; the weights have the last word (see refine)
        tie_embeddings=hf.raw.get("tie_word_embeddings") is not False,
        attention_scale=1.0,
        dropout=0.0,
        n_decoder_layers=decoder_layers,
    )


def refine(config: ModelConfig, raw: dict, tensors: Mapping[str, np.ndarray]) -> ModelConfig:
    head, shared = tensors.get("lm_head.weight"), tensors.get("shared.weight")
    separate = head is not None and (shared is None or not np.array_equal(head, shared))
    return config.replace(tie_embeddings=not separate)


def config_to_hf(config: ModelConfig, base: dict | None) -> dict:
    arch = "t5"
    require_layout(config, arch, LAYOUT)
    require_plain_attention(config, arch, "T5", fixed_head_dim=False)  # d_kv is free
    require_ours(config, arch, "attention_scale", 1.0, "T5 does not scale attention logits")
    proj = mlp_to_hf(config, arch, gated=None, why="no Hugging Face activation has its name")
    if config.mlp.gated:
        proj = GATED_GELU if proj == GATED_GELU_ACT else f"gated-{proj}"
    hf = dict(base or {})
    for alias in ALIASES:
        hf.pop(alias, None)
    # Keep the source's convention; a model trained here gets T5's own (tied <=> scaled).
    scale = scales_decoder_output(hf) if base is not None else config.tie_embeddings
    hf.update(
        architectures=["T5ForConditionalGeneration"],
        model_type="t5",
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        d_kv=config.dims_per_head,
        d_ff=config.ff_dim,
        num_layers=config.n_layers,
        num_decoder_layers=config.decoder_layers,
        num_heads=config.n_heads,
        relative_attention_num_buckets=config.position.num_buckets,
        relative_attention_max_distance=config.position.max_distance,
        layer_norm_epsilon=config.norm.eps,
        feed_forward_proj=proj,
        is_encoder_decoder=True,
        tie_word_embeddings=config.tie_embeddings,
        scale_decoder_outputs=scale,
    )
    for derived in ("dense_act_fn", "is_gated_act"):  # recomputed by T5Config
        hf.pop(derived, None)
    if base is None:
        hf.update(dropout_rate=config.dropout, decoder_start_token_id=0, pad_token_id=0,
                  eos_token_id=1)
    return hf


def rules(config: ModelConfig, hf_config: dict | None = None) -> list[Rule]:
    C, H, D, F = config.d_model, config.n_heads, config.dims_per_head, config.ff_dim
    s = np.float32(config.d_model**-0.5) if scales_decoder_output(hf_config or {}) else None

    def scaled(w):  # fold the decoder-output factor into the final norm (see the docstring)
        return (w if s is None else (w.astype(np.float64) * float(s)).astype(w.dtype),)

    def unscaled(w):
        return (w if s is None else (w.astype(np.float64) / float(s)).astype(w.dtype),)

    out = [
        copy("shared.weight", "embed/tokens/embedding"),
        copy("encoder.final_layer_norm.weight", "encoder/final_norm/scale"),
        Rule(("decoder.final_layer_norm.weight",), ("decoder/final_norm/scale",), scaled,
             unscaled),
        copy("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "encoder/relative_bias/rel_embedding"),
        copy("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "decoder/relative_bias/rel_embedding"),
    ]

    def attention(hf: str, ours: str) -> list[Rule]:
        return [
            linear(hf + "q.weight", ours + "query/kernel", (C,), (H, D)),
            linear(hf + "k.weight", ours + "key/kernel", (C,), (H, D)),
            linear(hf + "v.weight", ours + "value/kernel", (C,), (H, D)),
            linear(hf + "o.weight", ours + "out/kernel", (H, D), (C,)),
        ]

    def mlp(hf: str, ours: str) -> list[Rule]:
        if config.mlp.gated:  # a gate and an up projection
            return [
                linear(hf + "wi_0.weight", ours + "gate/kernel", (C,), (F,)),
                linear(hf + "wi_1.weight", ours + "up/kernel", (C,), (F,)),
                linear(hf + "wo.weight", ours + "down/kernel", (F,), (C,)),
            ]
        return [
            linear(hf + "wi.weight", ours + "up/kernel", (C,), (F,)),
            linear(hf + "wo.weight", ours + "down/kernel", (F,), (C,)),
        ]

    for i in range(config.n_layers):
        hf, ours = f"encoder.block.{i}.layer.", f"encoder/layer_{i}/"
        out += attention(hf + "0.SelfAttention.", ours + "attention/")
        out += [copy(hf + "0.layer_norm.weight", ours + "norm1/scale"),
                copy(hf + "1.layer_norm.weight", ours + "norm2/scale")]
        out += mlp(hf + "1.DenseReluDense.", ours + "mlp/")
    for i in range(config.decoder_layers):
        hf, ours = f"decoder.block.{i}.layer.", f"decoder/layer_{i}/"
        out += attention(hf + "0.SelfAttention.", ours + "attention/")
        out += attention(hf + "1.EncDecAttention.", ours + "cross_attention/")
        out += [copy(hf + "0.layer_norm.weight", ours + "norm1/scale"),
                copy(hf + "1.layer_norm.weight", ours + "norm_cross/scale"),
                copy(hf + "2.layer_norm.weight", ours + "norm2/scale")]
        out += mlp(hf + "2.DenseReluDense.", ours + "mlp/")
    if not config.tie_embeddings:
        out.append(linear("lm_head.weight", "lm_head/kernel", (C,), (config.vocab_size,)))
    return out


ARCHITECTURES.add(
    "t5",
    Architecture(
        model_type="t5",
        hf_classes=("T5ForConditionalGeneration",),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        # copies of the shared embedding, and a bias table transformers itself never uses
        ignore=r"^((encoder|decoder)\.embed_tokens\.weight"
        r"|decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight)$",
        hf_auto="AutoModelForSeq2SeqLM",
        refine=refine,
    ),
)
