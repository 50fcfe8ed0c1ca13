"""GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) <-> our ``gpt`` family.

GPT-2 is our GPT with ``position=learned`` (a ``[n_positions, C]`` table), pre-LayerNorm
blocks with biases, tanh-approximated GELU and tied embeddings. Its projections are ``Conv1D``
layers whose weights are stored ``[in, out]``, and one ``c_attn`` holds query, key and value
side by side (``[C, 3C]``), each split head-major into ``[H, D]``.
"""

from __future__ import annotations

import numpy as np

from transformers_jax.config import ModelConfig
from transformers_jax.convert.common import (
    ARCHITECTURES,
    EXACT_GELU,
    TANH_GELUS,
    Architecture,
    HFConfig,
    Rule,
    activation_from_hf,
    activation_to_hf,
    build_config,
    conv1d,
    copy,
    require_ours,
)

# GPT2Config's defaults for the fields read here (a config.json may omit any of them).
DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}
# config.json may use the generic names (GPT2Config.attribute_map).
ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}


def config_from_hf(raw: dict) -> ModelConfig:
    raw = {ALIASES.get(k, k): v for k, v in raw.items()}
    hf = HFConfig(raw, DEFAULTS, "gpt2")
    mlp = activation_from_hf("gpt2", "activation_function", hf["activation_function"])
    hf.require("scale_attn_by_inverse_layer_idx", False,
               "attention scaled by 1/(layer index + 1) differs per layer; ModelConfig has one "
               "attention_scale for all layers")
    hf.require("add_cross_attention", False,
               "GPT-2 with cross-attention is a decoder of an encoder-decoder; convert a plain "
               "language model")
    # reorder_and_upcast_attn only changes the order and precision of float16 arithmetic; in
    # float32 (how we convert and compute by default) it is the same function.
    n_embd, n_head = hf["n_embd"], hf["n_head"]
    return build_config(
        "gpt2",
        family="gpt",
        vocab_size=hf["vocab_size"],
        d_model=n_embd,
        n_layers=hf["n_layer"],
        n_heads=n_head,
        d_ff=hf.get("n_inner", 4 * n_embd),
        max_len=hf["n_positions"],
        mask="causal",
        position="learned",
        norm="layernorm",
        norm_position="pre",
        norm_eps=float(hf["layer_norm_epsilon"]),
        mlp=mlp,
        use_bias=True,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        attention_scale=None if hf["scale_attn_weights"] else 1.0,
        init_std=float(hf["initializer_range"]),
        dropout=0.0,
    )


def config_to_hf(config: ModelConfig, base: dict | None) -> dict:
    arch = "gpt2"
    require_ours(config, arch, "family", "gpt", "GPT-2 is a decoder-only language model")
    require_ours(config, arch, "mask", "causal", "GPT-2 attends causally")
    require_ours(config, arch, "position", "learned", "GPT-2 learns a position table")
    require_ours(config, arch, "norm", "layernorm", "GPT-2 uses LayerNorm")
    require_ours(config, arch, "norm_position", "pre", "GPT-2 normalises before each block")
    require_ours(config, arch, "mlp", ("gelu", "relu", EXACT_GELU), "GPT-2's MLP is not gated")
    require_ours(config, arch, "use_bias", True, "GPT-2 has biases everywhere")
    require_ours(config, arch, "n_kv_heads", (None, config.n_heads), "GPT-2 has no GQA")
    require_ours(config, arch, "head_dim", (None, config.d_model // config.n_heads),
                 "GPT-2 heads are d_model / n_heads wide")
    for name in ("qk_norm",):
        require_ours(config, arch, name, False, "GPT-2 does not normalise q and k")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
        require_ours(config, arch, name, None, "GPT-2 does not soft-cap logits")
    default_scale = config.dims_per_head**-0.5
    if config.attention_scale not in (None, 1.0, default_scale):
        require_ours(config, arch, "attention_scale", (None, 1.0),
                     "GPT-2 scales by 1/sqrt(head_dim) or not at all")
    hf = dict(base or {})
    for alias in ALIASES:  # keep one spelling of each field
        hf.pop(alias, None)
    activation = activation_to_hf(config.mlp)
    if config.mlp == "gelu" and hf.get("activation_function") in TANH_GELUS:
        activation = hf["activation_function"]  # keep the source's spelling of tanh-GELU
    hf.update(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=config.vocab_size,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=None if config.ff_dim == 4 * config.d_model else config.ff_dim,
        n_positions=config.max_len,
        layer_norm_epsilon=config.norm_eps,
        activation_function=activation,
        scale_attn_weights=config.attention_scale != 1.0,
        scale_attn_by_inverse_layer_idx=False,
        add_cross_attention=False,
        tie_word_embeddings=config.tie_embeddings,
        initializer_range=config.init_std,
    )
    if base is None:
        hf.update(resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=0.0)
    return hf


def rules(config: ModelConfig, hf_config: dict | None = None) -> list[Rule]:
    C, H, D, F = config.d_model, config.n_heads, config.dims_per_head, config.ff_dim

    def split_qkv(w):  # [C, 3C] -> three [C, H, D]; a [3C] bias -> three [H, D]
        return tuple(p.reshape(*w.shape[:-1], H, D) for p in np.split(w, 3, axis=-1))

    def join_qkv(*parts):
        return (np.concatenate([p.reshape(*p.shape[: p.ndim - 2], H * D) for p in parts], -1),)

    out = [
        copy("wte.weight", "embed/tokens/embedding"),
        copy("wpe.weight", "embed/table/embedding"),
        copy("ln_f.weight", "final_norm/scale"),
        copy("ln_f.bias", "final_norm/bias"),
    ]
    for i in range(config.n_layers):
        hf, ours = f"h.{i}.", f"layer_{i}/"
        att = ours + "attention/"
        out += [
            copy(hf + "ln_1.weight", ours + "norm1/scale"),
            copy(hf + "ln_1.bias", ours + "norm1/bias"),
            Rule((hf + "attn.c_attn.weight",),
                 tuple(att + f"{n}/kernel" for n in ("query", "key", "value")),
                 split_qkv, join_qkv),
            Rule((hf + "attn.c_attn.bias",),
                 tuple(att + f"{n}/bias" for n in ("query", "key", "value")),
                 split_qkv, join_qkv),
            conv1d(hf + "attn.c_proj.weight", att + "out/kernel", (H, D), (C,)),
            copy(hf + "attn.c_proj.bias", att + "out/bias"),
            copy(hf + "ln_2.weight", ours + "norm2/scale"),
            copy(hf + "ln_2.bias", ours + "norm2/bias"),
            conv1d(hf + "mlp.c_fc.weight", ours + "mlp/up/kernel", (C,), (F,)),
            copy(hf + "mlp.c_fc.bias", ours + "mlp/up/bias"),
            conv1d(hf + "mlp.c_proj.weight", ours + "mlp/down/kernel", (F,), (C,)),
            copy(hf + "mlp.c_proj.bias", ours + "mlp/down/bias"),
        ]
    if not config.tie_embeddings:
        out.append(Rule(("lm_head.weight",), ("lm_head/kernel",), lambda w: (w.T,),
                        lambda k: (k.T,)))
    return out


ARCHITECTURES.add(
    "gpt2",
    Architecture(
        model_type="gpt2",
        hf_classes=("GPT2LMHeadModel", "GPT2Model"),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        prefixes=("transformer.",),
        export_prefix="transformer.",
        ignore=r"^h\.\d+\.attn\.(masked_)?bias$",  # causal-mask buffers of old checkpoints
    ),
)
