"""Llama (``LlamaForCausalLM``, ``LlamaModel``) and Mistral <-> our ``gpt`` family.

Llama is our GPT with ``position=rope`` (rotate-half pairing, so Hugging Face's q/k layout
needs no permutation), RMSNorm, a gated MLP (``hidden_act="silu"``: SwiGLU; any gated MLP whose
registry entry names that activation, e.g. ``gelu_pytorch_tanh``: our ``geglu``), optional GQA,
no biases and an untied head by default.
``torch.nn.Linear`` weights are ``[out, in]``; our kernels are ``[in, out]`` with heads split
out (query ``[C, H, D]``, key/value ``[C, N, D]``, output ``[H, D, C]``).

Mistral is Llama without biases plus an optional ``sliding_window`` (a key is visible when
``query - key < window``: our ``mask=sliding_window`` with the same ``window``).
"""

from __future__ import annotations

import functools

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
    require_ours,
    reshape,
    unsupported,
)
from transformers_jax.convert.rope import rope_from_hf, rope_to_hf

# LlamaConfig's defaults for the fields read here.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


# MistralConfig's defaults where they differ; it has no bias fields (never biases).
MISTRAL_DEFAULTS = {
    **DEFAULTS,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}


def config_from_hf(raw: dict, model_type: str = "llama") -> ModelConfig:
    if model_type == "mistral":
        raw = {k: v for k, v in raw.items() if k not in ("attention_bias", "mlp_bias")}
        hf = HFConfig(raw, MISTRAL_DEFAULTS, model_type)
        window = hf.raw.get("sliding_window", MISTRAL_DEFAULTS["sliding_window"])
    else:
        hf = HFConfig(raw, DEFAULTS, model_type)
        window = None
    if bool(hf["attention_bias"]) != bool(hf["mlp_bias"]):
        raise unsupported(
            model_type, "attention_bias", hf["attention_bias"],
            f"with mlp_bias={hf['mlp_bias']}: ModelConfig.use_bias puts biases in all dense "
            "layers or in none",
        )
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim", hf["hidden_size"] // heads)
    return build_config(
        model_type,
        family="gpt",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        max_len=hf["max_position_embeddings"],
        mask="causal" if window is None else {"name": "sliding_window", "window": window},
        position=rope_from_hf(hf, head_dim),
        norm={"name": "rmsnorm", "eps": float(hf["rms_norm_eps"])},
        norm_position="pre",
        mlp=mlp_from_hf(model_type, "hidden_act", hf["hidden_act"], gated=True),  # silu: swiglu
        use_bias=bool(hf["attention_bias"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=float(hf["initializer_range"]),
        dropout=0.0,
    )


def config_to_hf(config: ModelConfig, base: dict | None, model_type: str = "llama") -> dict:
    arch = model_type
    require_ours(config, arch, "family", "gpt", "Llama is a decoder-only language model")
    if model_type == "mistral":
        require_ours(config, arch, "mask", ("causal", "sliding_window"),
                     "Mistral attends causally, optionally within a sliding window")
        require_ours(config, arch, "use_bias", False, "Mistral has no biases")
    else:
        require_ours(config, arch, "mask", "causal",
                     "Llama attends causally (Mistral has the sliding window)")
    require_ours(config, arch, "position", "rope", "Llama uses rotary embeddings")
    require_ours(config, arch, "position.fraction", 1.0, "Llama rotates whole heads")
    require_ours(config, arch, "norm", "rmsnorm", "Llama uses RMSNorm")
    require_ours(config, arch, "norm_position", "pre", "Llama normalises before each block")
    hidden_act = mlp_to_hf(config, arch, gated=True, why="Llama's MLP is gated (SwiGLU)")
    require_ours(config, arch, "qk_norm", False, "Llama does not normalise q and k")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
        require_ours(config, arch, name, None, "Llama does not soft-cap logits")
    require_ours(config, arch, "attention_scale", (None, config.dims_per_head**-0.5),
                 "Llama scales attention by 1/sqrt(head_dim)")
    rope_parameters, pinned_len = rope_to_hf(config.position, arch)
    hf = dict(base or {})
    hf.pop("rope_scaling", None)  # the old spelling would take priority over rope_parameters
    hf.update(
        architectures=["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ff_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.dims_per_head,
        hidden_act=hidden_act,
        max_position_embeddings=pinned_len or config.max_len,
        rms_norm_eps=config.norm.eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=rope_parameters,
        rope_theta=config.position.base,
        initializer_range=config.init_std,
    )
    if model_type == "mistral":
        hf["sliding_window"] = getattr(config.mask, "window", None)  # None: no window
    else:
        hf.update(attention_bias=config.use_bias, mlp_bias=config.use_bias)
    hf.pop("original_max_position_embeddings", None)  # it would override the rope's own
    if base is None:
        hf.update(attention_dropout=0.0)
    return hf


def rules(config: ModelConfig, hf_config: dict | None = None) -> list[Rule]:
    C, H, N, D, F = (config.d_model, config.n_heads, config.kv_heads, config.dims_per_head,
                     config.ff_dim)
    out = [
        copy("embed_tokens.weight", "embed/tokens/embedding"),
        copy("norm.weight", "final_norm/scale"),
    ]
    for i in range(config.n_layers):
        hf, ours = f"layers.{i}.", f"layer_{i}/"
        att, mlp = hf + "self_attn.", ours + "mlp/"
        out += [
            copy(hf + "input_layernorm.weight", ours + "norm1/scale"),
            linear(att + "q_proj.weight", ours + "attention/query/kernel", (C,), (H, D)),
            linear(att + "k_proj.weight", ours + "attention/key/kernel", (C,), (N, D)),
            linear(att + "v_proj.weight", ours + "attention/value/kernel", (C,), (N, D)),
            linear(att + "o_proj.weight", ours + "attention/out/kernel", (H, D), (C,)),
            copy(hf + "post_attention_layernorm.weight", ours + "norm2/scale"),
            linear(hf + "mlp.gate_proj.weight", mlp + "gate/kernel", (C,), (F,)),
            linear(hf + "mlp.up_proj.weight", mlp + "up/kernel", (C,), (F,)),
            linear(hf + "mlp.down_proj.weight", mlp + "down/kernel", (F,), (C,)),
        ]
        if config.use_bias:
            out += [
                reshape(att + "q_proj.bias", ours + "attention/query/bias", (H * D,), (H, D)),
                reshape(att + "k_proj.bias", ours + "attention/key/bias", (N * D,), (N, D)),
                reshape(att + "v_proj.bias", ours + "attention/value/bias", (N * D,), (N, D)),
                copy(att + "o_proj.bias", ours + "attention/out/bias"),
                copy(hf + "mlp.gate_proj.bias", mlp + "gate/bias"),
                copy(hf + "mlp.up_proj.bias", mlp + "up/bias"),
                copy(hf + "mlp.down_proj.bias", mlp + "down/bias"),
            ]
    if not config.tie_embeddings:
        out.append(linear("lm_head.weight", "lm_head/kernel", (C,), (config.vocab_size,)))
    return out


for _type, _classes in (("llama", ("LlamaForCausalLM", "LlamaModel")),
                        ("mistral", ("MistralForCausalLM", "MistralModel"))):
    ARCHITECTURES.add(
        _type,
        Architecture(
            model_type=_type,
            hf_classes=_classes,
            config_from_hf=functools.partial(config_from_hf, model_type=_type),
            config_to_hf=functools.partial(config_to_hf, model_type=_type),
            rules=rules,
            prefixes=("model.",),
            export_prefix="model.",
            ignore=r"rotary_emb\.inv_freq$",  # a cached buffer in older checkpoints
        ),
    )
