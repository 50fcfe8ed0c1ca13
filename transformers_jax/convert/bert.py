"""BERT (``BertForMaskedLM``, ``BertForPreTraining``) <-> our ``bert`` family.

BERT is our masked-LM encoder with learned positions, token-type embeddings, post-LayerNorm
blocks (``norm1`` after attention, ``norm2`` after the MLP, ``embed_norm`` on the embedding
sum), biases everywhere and the MLM head ``transform -> act -> LayerNorm -> tied projection +
bias``. ``torch.nn.Linear`` weights are ``[out, in]``.

BERT's own ``hidden_act="gelu"`` is the exact (erf) GELU, our ``gelu_exact`` MLP (``gelu_new``
is the tanh approximation, our ``gelu``); the activation is looked up in the MLP registry, where
each entry names its Hugging Face activations. The pooler and next-sentence head of
``BertForPreTraining`` do not affect masked-LM logits and are left out (an exported model has
none).
"""

from __future__ import annotations

from transformers_jax.config import ModelConfig
from transformers_jax.convert.common import (
    ARCHITECTURES,
    Architecture,
    HFConfig,
    Rule,
    build_config,
    copy,
    dense,
    layer_norm,
    linear,
    mlp_from_hf,
    mlp_to_hf,
    pinned,
    require_layout,
    require_ours,
    require_plain_attention,
    reshape,
)

DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    "position_embedding_type": "absolute",
}
LAYOUT = {  # what BERT fixes (see common.Layout)
    "family": ("bert", "BERT is a masked-LM encoder"),
    "mask": ("bidirectional", "BERT attends both ways"),
    "position": ("learned", "BERT learns a position table"),
    "norm": ("layernorm", "BERT uses LayerNorm"),
    "norm_position": ("post", "BERT normalises after each block"),
    "use_bias": (True, "BERT has biases everywhere"),
}


def config_from_hf(raw: dict) -> ModelConfig:
    hf = HFConfig(raw, DEFAULTS, "bert")
    hf.require("is_decoder", False, "a causal BERT is not the masked-LM encoder this maps to")
    hf.require("add_cross_attention", False, "BERT with cross-attention is a decoder")
    hf.require("position_embedding_type", "absolute",
               "relative-key position embeddings are not implemented here")
    return build_config(
        "bert",
        **pinned(LAYOUT, norm={"eps": float(hf["layer_norm_eps"])}),
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        max_len=hf["max_position_embeddings"],
        mlp=mlp_from_hf("bert", "hidden_act", hf["hidden_act"], gated=False),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=float(hf["initializer_range"]),
        dropout=0.0,
        type_vocab_size=hf["type_vocab_size"],
    )


def config_to_hf(config: ModelConfig, base: dict | None) -> dict:
    arch = "bert"
    require_layout(config, arch, LAYOUT)
    require_plain_attention(config, arch, "BERT")
    require_ours(config, arch, "attention_scale", (None, config.dims_per_head**-0.5),
                 "BERT scales attention by 1/sqrt(head_dim)")
    hf = dict(base or {})
    hf.update(
        architectures=["BertForMaskedLM"],
        model_type="bert",
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        intermediate_size=config.ff_dim,
        hidden_act=mlp_to_hf(config, arch, gated=False, why="BERT's MLP is not gated"),
        max_position_embeddings=config.max_len,
        type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.norm.eps,
        tie_word_embeddings=config.tie_embeddings,
        is_decoder=False,
        add_cross_attention=False,
        initializer_range=config.init_std,
    )
    hf.pop("position_embedding_type", None)
    if base is None:
        hf.update(hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=0.0)
    return hf


def rules(config: ModelConfig, hf_config: dict | None = None) -> list[Rule]:
    C, H, D, F = config.d_model, config.n_heads, config.dims_per_head, config.ff_dim
    enc, emb = "encoder/", "embeddings."
    out = [
        copy(emb + "word_embeddings.weight", enc + "embed/tokens/embedding"),
        copy(emb + "position_embeddings.weight", enc + "embed/table/embedding"),
        *layer_norm(emb + "LayerNorm.", enc + "embed_norm/"),
        *dense("cls.predictions.transform.dense.", "mlm_head/transform/", (C,), (C,)),
        *layer_norm("cls.predictions.transform.LayerNorm.", "mlm_head/norm/"),
    ]

    if config.type_vocab_size:
        out.append(copy(emb + "token_type_embeddings.weight",
                        enc + "token_type_embed/embedding"))
    if config.tie_embeddings:
        out.append(copy("cls.predictions.bias", "mlm_head/output_bias"))
    else:  # untied, transformers computes with the decoder's own bias; `bias` is unused then
        out += [
            linear("cls.predictions.decoder.weight", "mlm_head/output/kernel", (C,),
                   (config.vocab_size,)),
            Rule(("cls.predictions.decoder.bias", "cls.predictions.bias"),
                 ("mlm_head/output_bias",), lambda used, unused: (used,), lambda b: (b, b)),
        ]
    for i in range(config.n_layers):
        hf, ours = f"encoder.layer.{i}.", f"{enc}layer_{i}/"
        att = ours + "attention/"
        for name in ("query", "key", "value"):
            out += [
                linear(hf + f"attention.self.{name}.weight", att + f"{name}/kernel", (C,), (H, D)),
                reshape(hf + f"attention.self.{name}.bias", att + f"{name}/bias", (H * D,),
                        (H, D)),
            ]
        out += [
            *dense(hf + "attention.output.dense.", att + "out/", (H, D), (C,)),
            *layer_norm(hf + "attention.output.LayerNorm.", ours + "norm1/"),
            *dense(hf + "intermediate.dense.", ours + "mlp/up/", (C,), (F,)),
            *dense(hf + "output.dense.", ours + "mlp/down/", (F,), (C,)),
            *layer_norm(hf + "output.LayerNorm.", ours + "norm2/"),
        ]
    return out


def _rename(name: str) -> str:
    """Old TensorFlow-era names: ``LayerNorm.gamma``/``beta`` are ``weight``/``bias``."""
    if name.endswith(".gamma"):
        return name[: -len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[: -len("beta")] + "bias"
    return name


ARCHITECTURES.add(
    "bert",
    Architecture(
        model_type="bert",
        hf_classes=("BertForMaskedLM", "BertForPreTraining"),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        rules=rules,
        prefixes=("bert.",),
        export_prefix="bert.",
        top_level=("cls.",),
        # buffers, and the parts of BertForPreTraining that masked-LM logits never use
        ignore=r"^(embeddings\.position_ids|pooler\.|cls\.seq_relationship\.)",
        tied_heads=("cls.predictions.decoder.weight",),
        tied_aliases={"cls.predictions.bias": ("cls.predictions.decoder.bias",)},
        rename=_rename,
        hf_auto="AutoModelForMaskedLM",
    ),
)
