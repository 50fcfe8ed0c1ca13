"""BERT-style bidirectional encoder with a masked-LM head (Devlin et al. 2019).

Shape legend: B batch, T length, C model width, V vocabulary, Y token types.

``BertEncoder`` is the stack: token embedding (+ absolute positions when the scheme has them)
+ token-type (segment A/B) embedding, then the layers of the shared ``Block``. The config's mask
switch applies as for GPT (``bidirectional`` is the natural choice for an encoder), and
``segment_ids`` keep packed documents apart; padding is segment 0, so it needs no extra mask.
Post-norm (BERT): the embedding sum is normalised before the first layer and every block ends in
a norm. Pre-norm: no embedding norm, a final norm after the last block.

``BERT`` adds the masked-LM head: ``dense -> activation -> norm -> projection to the vocabulary
(the input embedding, transposed, when ``tie_embeddings``) + an output bias``. The parameter
tree is ``{"encoder": ..., "mlm_head": ...}``, so fine-tuning heads (``models/heads.py``) reuse
``params["encoder"]`` as it is. The family's entry is ``bert`` in ``family.py``.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import ModelConfig
from transformers_jax.models.gpt import check_length, default_positions
from transformers_jax.nn.attention import every_key
from transformers_jax.nn.layers import Dense, Embedder, dtype_of, make_embed, softcap, tied_logits
from transformers_jax.nn.masks import build_mask
from transformers_jax.nn.stack import LayerStack, encoding_positions


def check_mlm_mask(config: ModelConfig) -> None:
    """Warn when a masked-LM encoder is not bidirectional: it is allowed (an ablation), but a
    causal mask hides the right context that masked-LM prediction is meant to use."""
    if config.mask.causal or config.mask.needs_prefix_len:
        warnings.warn(
            f"mask={config.mask.name!r} with the masked-LM objective: each masked token sees only "
            "part of its context; mask='bidirectional' is the usual choice for BERT",
            UserWarning,
            stacklevel=3,
        )


class BertEncoder(nn.Module):
    """``tokens [B, T] -> hidden states [B, T, C]``, plus the token table for a tied head.

    Parameters: ``embed``, ``token_type_embed``, ``embed_norm`` (post-norm), ``relative_bias``
    (bias schemes), ``layer_i`` (or ``layers``), ``final_norm`` (pre-norm).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = Embedder(cfg)
        if cfg.type_vocab_size:
            self.token_type_embed = make_embed(cfg, cfg.type_vocab_size, (None, "embed"))
        if cfg.norm_position.embedding_norm:
            self.embed_norm = cfg.norm.layer(cfg)
        # One bias module for the whole stack, as in T5 (None for schemes without a bias).
        self.relative_bias = cfg.position.bias(cfg, not cfg.mask.causal)
        self.stack = LayerStack(cfg, cfg.n_layers)
        nn.share_scope(self, self.stack)
        self.dropout = nn.Dropout(cfg.dropout)

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        token_types: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_len: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        cfg = self.config
        check_length(cfg, tokens_BT.shape[1])
        positions_BT = default_positions(tokens_BT) if positions is None else positions
        mask = build_mask(cfg.mask, positions_BT, positions_BT, prefix_len=prefix_len,
                          q_segments=segment_ids, kv_segments=segment_ids,
                          aligned=positions is None)
        positions_BT = encoding_positions(self, cfg, positions_BT, deterministic, segment_ids)

        x_BTC = self.embed(tokens_BT, positions_BT)
        if cfg.type_vocab_size:
            types_BT = jnp.zeros_like(tokens_BT) if token_types is None else token_types
            x_BTC = x_BTC + self.token_type_embed(types_BT)
        elif token_types is not None:
            raise ValueError("token_types given but the model has no token-type table "
                             "(type_vocab_size=0)")
        # A zero "perturbation" hook: lets tests take gradients w.r.t. the embedded inputs.
        x_BTC = self.perturb("embeddings", x_BTC)
        if cfg.norm_position.embedding_norm:
            x_BTC = self.embed_norm(x_BTC)
        x_BTC = self.dropout(x_BTC, deterministic=deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))

        bias_BHTT = (None if self.relative_bias is None
                     else self.relative_bias(positions_BT, every_key(positions_BT)))
        x_BTC, _ = self.stack(x_BTC, positions=positions_BT, mask=mask, bias=bias_BHTT,
                              deterministic=deterministic)
        return x_BTC

    def embedding_table(self) -> jax.Array:
        """The token embedding ``[V, C]`` (what a tied output projection multiplies by)."""
        return self.embed.table_VC()


class MLMHead(nn.Module):
    """``hidden [B, T, C] -> logits [B, T, V]``: dense, activation, norm, projection + bias.

    The projection is ``embedding_VC`` transposed when given (tied, BERT's default), otherwise
    its own ``[C, V]`` kernel. The activation is the MLP's (``gelu`` for BERT).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, h_BTC: jax.Array, embedding_VC: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        dense = dict(dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
        h_BTC = Dense((cfg.d_model,), ("embed", "mlp"), use_bias=cfg.use_bias, std=cfg.init_std,
                      name="transform", **dense)(h_BTC)
        h_BTC = cfg.mlp.activation(h_BTC)
        h_BTC = cfg.norm.layer(cfg, "norm")(h_BTC)
        if embedding_VC is None:
            logits_BTV = Dense((cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                               std=cfg.init_std, name="output", **dense)(h_BTC)
        else:
            logits_BTV = tied_logits(h_BTC, embedding_VC, dense["dtype"])
        bias_V = self.param(
            "output_bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
            (cfg.vocab_size,),
            dense["param_dtype"],
        )
        logits_BTV = logits_BTV.astype(jnp.float32) + bias_V.astype(jnp.float32)
        logits_BTV = softcap(logits_BTV, cfg.final_logit_softcap)
        return nn.with_logical_constraint(logits_BTV, ("batch", "length", "vocab"))


class BERT(nn.Module):
    """Masked-LM encoder: ``tokens [B, T] -> logits [B, T, V]`` (float32).

    ``apply`` takes ``BertEncoder``'s keywords, passed on as they are: ``token_types``,
    ``positions``, ``segment_ids`` (0 = padding), ``prefix_len`` (mask=prefix) and
    ``deterministic``; ``method="encode"`` returns the hidden states ``[B, T, C]`` instead of
    logits.
    """

    config: ModelConfig

    def setup(self) -> None:
        self.encoder = BertEncoder(self.config)
        self.mlm_head = MLMHead(self.config)

    def __call__(self, tokens_BT: jax.Array, **inputs) -> jax.Array:
        # ``inputs`` go to BertEncoder unchanged: its signature is the one list of them.
        check_mlm_mask(self.config)
        h_BTC = self.encode(tokens_BT, **inputs)
        table_VC = self.encoder.embedding_table() if self.config.tie_embeddings else None
        return self.mlm_head(h_BTC, table_VC)

    def encode(self, tokens_BT: jax.Array, **kwargs) -> jax.Array:
        """The encoder's hidden states ``[B, T, C]`` (same keyword arguments as the call)."""
        return self.encoder(tokens_BT, **kwargs)


# fill-mask -------------------------------------------------------------------------------------


def encode_with_masks(tokenizer, text: str, mask_token: str = "[MASK]") -> np.ndarray:
    """``[CLS] text [SEP]`` as ids, each ``mask_token`` in the text becoming the ``[MASK]`` id."""
    pieces = text.split(mask_token)
    if len(pieces) == 1:
        raise ValueError(f"no {mask_token} in the text {text!r}; put {mask_token} where a token "
                         "should be predicted")
    special = tokenizer.special
    ids: list[int] = [special["cls"]]
    for i, piece in enumerate(pieces):
        ids.extend(int(t) for t in tokenizer.encode(piece))
        if i + 1 < len(pieces):
            ids.append(special["mask"])
    ids.append(special["sep"])
    return np.asarray(ids, np.int32)


def fill_mask(
    model: nn.Module,
    params,
    tokenizer,
    text: str,
    top_k: int = 5,
    mask_token: str = "[MASK]",
) -> list[list[dict]]:
    """The ``top_k`` predictions for every ``[MASK]`` in ``text``, most likely first.

    Returns one list per ``[MASK]`` (in order) of ``{"token_id", "token", "score"}``, where the
    score is the softmax probability over ordinary (non-special) tokens. The input is framed as
    the masked-LM batches are, ``[CLS] text [SEP]``; with the byte tokenizer each ``[MASK]``
    stands for one byte.
    """
    if top_k <= 0:
        raise ValueError(f"top_k={top_k}: must be positive")
    ids_T = encode_with_masks(tokenizer, text, mask_token)
    logits_TV = model.apply({"params": params}, jnp.asarray(ids_T)[None])[0]
    specials = np.asarray(sorted(tokenizer.special.values()))
    specials = specials[specials < logits_TV.shape[-1]]
    logits_TV = logits_TV.at[:, specials].set(-jnp.inf)  # never predict pad, [MASK], ...
    probs_TV = np.asarray(jax.nn.softmax(logits_TV, axis=-1))
    results = []
    for t in np.flatnonzero(ids_T == tokenizer.special["mask"]):
        best = np.argsort(-probs_TV[t], kind="stable")[:top_k]
        results.append([
            {"token_id": int(i), "token": tokenizer.decode([int(i)]),
             "score": float(probs_TV[t, i])}
            for i in best
        ])
    return results
