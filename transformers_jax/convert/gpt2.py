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
    Architecture,
    HFConfig,
    Rule,
    build_config,
    conv1d,
    copy,
    dense,
    layer_norm,
    mlp_from_hf,
    mlp_to_hf,
    pinned,
    require_layout,
    require_ours,
    require_plain_attention,
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
LAYOUT = {  # what GPT-2 fixes (see common.Layout)
    "family": ("gpt", "GPT-2 is a decoder-only language model"),
    "mask": ("causal", "GPT-2 attends causally"),
    "position": ("learned", "GPT-2 learns a position table"),
    "norm": ("layernorm", "GPT-2 uses LayerNorm"),
    "norm_position": ("pre", "GPT-2 normalises before each block"),
    "use_bias": (True, "GPT-2 has biases everywhere"),
}


def config_from_hf(raw: dict) -> ModelConfig:
    raw = {ALIASES.get(k, k): v for k, v in raw.items()}
    hf = HFConfig(raw, DEFAULTS, "gpt2")
    mlp = mlp_from_hf("gpt2", "activation_function", hf["activation_function"], gated=False)
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
        **pinned(LAYOUT, norm={"eps": float(hf["layer_norm_epsilon"])}),
        vocab_size=hf["vocab_size"],
        d_model=n_embd,
        n_layers=hf["n_layer"],
        n_heads=n_head,
        d_ff=hf.get("n_inner", 4 * n_embd),
        max_len=hf["n_positions"],
        mlp=mlp,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        attention_scale=None if hf["scale_attn_weights"] else 1.0,
        init_std=float(hf["initializer_range"]),
        dropout=0.0,
    )


def config_to_hf(config: ModelConfig, base: dict | None) -> dict:
    arch = "gpt2"
    require_layout(config, arch, LAYOUT)
    require_plain_attention(config, arch, "GPT-2")
    default_scale = config.dims_per_head**-0.5
    if config.attention_scale not in (None, 1.0, default_scale):
        require_ours(config, arch, "attention_scale", (None, 1.0),
                     "GPT-2 scales by 1/sqrt(head_dim) or not at all")
    hf = dict(base or {})
    for alias in ALIASES:  # keep one spelling of each field
        hf.pop(alias, None)
    activation = mlp_to_hf(config, arch, gated=False, why="GPT-2's MLP is not gated")
    if hf.get("activation_function") in config.mlp.hf_names:
        activation = hf["activation_function"]  # keep the source's spelling (of tanh-GELU)
    hf.update(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=config.vocab_size,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=None if config.ff_dim == 4 * config.d_model else config.ff_dim,
        n_positions=config.max_len,
        layer_norm_epsilon=config.norm.eps,
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
        *layer_norm("ln_f.", "final_norm/"),
    ]
    for i in range(config.n_layers):
        hf, ours = f"h.{i}.", f"layer_{i}/"
        att = ours + "attention/"
        out += [
            *layer_norm(hf + "ln_1.", ours + "norm1/"),
            Rule((hf + "attn.c_attn.weight",),
                 tuple(att + f"{n}/kernel" for n in ("query", "key", "value")),
                 split_qkv, join_qkv),
            Rule((hf + "attn.c_attn.bias",),
                 tuple(att + f"{n}/bias" for n in ("query", "key", "value")),
                 split_qkv, join_qkv),
            *dense(hf + "attn.c_proj.", att + "out/", (H, D), (C,), conv1d),
            *layer_norm(hf + "ln_2.", ours + "norm2/"),
            *dense(hf + "mlp.c_fc.", ours + "mlp/up/", (C,), (F,), conv1d),
            *dense(hf + "mlp.c_proj.", ours + "mlp/down/", (F,), (C,), conv1d),
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
