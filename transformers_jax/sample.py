"""Sampling with the KV cache: prefill the prompts in one pass, then decode in one compiled loop.

Greedy, temperature, top-k and top-p (nucleus) sampling, stop tokens, a batch of prompts of
different lengths. Randomness enters only through the sampling key: greedy decoding is
deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from transformers_jax.config import ModelConfig
from transformers_jax.models import FAMILIES, family_of
from transformers_jax.nn.kvcache import init_cache, required_cache_size

NEG_INF = -1e30


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0  # written after a row has stopped
    bos_id: int | None = None  # first decoder token of an encoder-decoder

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be positive")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k={self.top_k}: must be a positive integer or None")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1] or None")


def filter_logits(logits_BV: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
    """Set every token outside the top-k / nucleus to -inf (the most likely is always kept)."""
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, NEG_INF, logits_BV)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(-logits_BV, axis=-1)
        sorted_logits = jnp.take_along_axis(logits_BV, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep a token while the mass of the tokens strictly before it is below top_p
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < top_p
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(logits_BV.shape[0])[:, None], order
        ].set(keep_sorted)
        logits_BV = jnp.where(keep, logits_BV, NEG_INF)
    return logits_BV


def choose_tokens(logits_BV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Next token per row, ``[B]`` int32."""
    if cfg.temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = filter_logits(logits_BV / cfg.temperature, cfg.top_k, cfg.top_p)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def check_decode_length(config: ModelConfig, total_len: int) -> None:
    limit = config.position.max_length(config)
    if limit is not None and total_len > limit:
        raise ValueError(
            f"prompt plus max_new_tokens is {total_len} tokens, longer than "
            f"position={config.position.name} allows (max_len={limit}); shorten the prompt or "
            "max_new_tokens"
        )


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, multiple: int = 16):
    """Right-pad to a common length (rounded up, so few shapes compile): ([B, P], lengths)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use bos for an empty prompt)")
    width = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, np.array([len(p) for p in prompts], np.int32)


def _decode_loop(step_fn, first_logits_BV, cache, key, cfg: SamplingConfig, on_token):
    """Sample the first token from ``first_logits_BV``, then loop (``lax.while_loop``) on
    ``step_fn(cache, tokens_B) -> (logits_BV, cache)`` until ``max_new_tokens`` or every row
    has emitted a stop token; rows that stopped get ``pad_id``. Returns ``[B, max_new]``."""
    B = first_logits_BV.shape[0]
    stops = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)

    def emit(step, token_B, done_B):
        token_B = jnp.where(done_B, cfg.pad_id, token_B)
        if on_token is not None:
            io_callback(on_token, None, step, token_B, done_B, ordered=True)
        return token_B, done_B | jnp.isin(token_B, stops)

    key, sub = jax.random.split(key)
    first_B, done_B = emit(0, choose_tokens(first_logits_BV, sub, cfg), jnp.zeros((B,), bool))
    out_BN = jnp.full((B, cfg.max_new_tokens), cfg.pad_id, jnp.int32).at[:, 0].set(first_B)

    def cond(carry):
        step, _, _, done_B, _, _ = carry
        return (step < cfg.max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        step, token_B, cache, done_B, out_BN, key = carry
        logits_BV, cache = step_fn(cache, token_B)
        key, sub = jax.random.split(key)
        token_B, new_done = emit(step, choose_tokens(logits_BV, sub, cfg), done_B)
        out_BN = out_BN.at[:, step].set(token_B)
        return step + 1, token_B, cache, new_done, out_BN, key

    carry = (jnp.int32(1), first_B, cache, done_B, out_BN, key)
    return jax.lax.while_loop(cond, body, carry)[4]


@functools.partial(jax.jit, static_argnames=("model", "cfg", "cache_size", "on_token"))
def _generate(model, params, tokens_BP, lengths_B, key, *, cfg, cache_size, on_token=None):
    """Decoder-only: prefill the right-padded prompts in one pass, then decode."""
    B = tokens_BP.shape[0]
    variables = {"params": params}
    cache = init_cache(model.config, B, cache_size)
    logits_BPV, cache = model.apply(variables, tokens_BP, cache=cache, lengths=lengths_B)
    ones = jnp.ones((B,), jnp.int32)

    def step_fn(cache, token_B):
        logits_B1V, cache = model.apply(variables, token_B[:, None], cache=cache, lengths=ones)
        return logits_B1V[:, 0], cache

    last_BV = logits_BPV[jnp.arange(B), lengths_B - 1]
    return _decode_loop(step_fn, last_BV, cache, key, cfg, on_token)


@functools.partial(jax.jit, static_argnames=("model", "cfg", "bos_id", "on_token"))
def _generate_seq2seq(model, params, sources_BS, valid_BS, key, *, cfg, bos_id, on_token=None):
    """Encoder-decoder: run the encoder once, project its keys/values into the cache at the
    first decoder step, then decode from ``bos``."""
    from transformers_jax.models.encdec import init_encdec_cache

    B, S = sources_BS.shape
    variables = {"params": params}
    encoded = model.apply(variables, sources_BS, encoder_segment_ids=valid_BS.astype(jnp.int32),
                          method="encode")
    cache = init_encdec_cache(model.config, B, cfg.max_new_tokens + 1, S, encoder_valid=valid_BS)
    bos = jnp.full((B, 1), bos_id, jnp.int32)
    logits_B1V, cache = model.apply(variables, bos, cache, encoded, method="decode_cached")

    def step_fn(cache, token_B):
        logits_B1V, cache = model.apply(variables, token_B[:, None], cache, None,
                                        method="decode_cached")
        return logits_B1V[:, 0], cache

    return _decode_loop(step_fn, logits_B1V[:, 0], cache, key, cfg, on_token)


def generate(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig = SamplingConfig(),
    *,
    seed: int = 0,
    on_token: Callable | None = None,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids); returns the new tokens of each row, cut at
    (and including) the first stop token. For an encoder-decoder the prompts are the source
    sequences and the decoder starts from ``cfg.bos_id``.

    ``on_token(step, tokens_B, done_B)`` is called from inside the compiled loop as each token
    is chosen (numpy arguments): the CLI streams text with it.
    """
    model_cfg: ModelConfig = model.config
    family = family_of(model_cfg)
    if family.generates == "seq2seq":
        return _seq2seq(model, params, prompts, cfg, seed, on_token)
    if family.generates != "self":
        raise ValueError(f"family={model_cfg.family!r} cannot generate with a KV cache; "
                         f"sampling is for {', '.join(generating_families())} models")
    if not model_cfg.mask.decodes:
        raise ValueError(
            f"sampling needs a mask that decodes left to right (causal, sliding_window, "
            f"prefix), but this model uses mask={model_cfg.mask.name!r}"
        )
    tokens, lengths = pad_prompts(prompts, cfg.pad_id)
    total = int(lengths.max()) + cfg.max_new_tokens
    check_decode_length(model_cfg, total)
    size = required_cache_size(model_cfg, tokens.shape[1] + cfg.max_new_tokens)
    out = _generate(
        model, params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed),
        cfg=cfg, cache_size=size, on_token=on_token,
    )
    return _cut_at_stops(out, cfg)


def _seq2seq(model, params, sources, cfg: SamplingConfig, seed: int, on_token):
    if cfg.bos_id is None:
        raise ValueError("an encoder-decoder starts decoding from bos: set SamplingConfig.bos_id")
    model_cfg = model.config
    # a learned table has no rows for padding past it: pad sources exactly then
    limited = model_cfg.position.max_length(model_cfg) is not None
    tokens, lengths = pad_prompts(sources, cfg.pad_id, multiple=1 if limited else 16)
    check_decode_length(model_cfg, max(int(lengths.max()), cfg.max_new_tokens + 1))
    valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    out = _generate_seq2seq(model, params, jnp.asarray(tokens), jnp.asarray(valid),
                            jax.random.key(seed), cfg=cfg, bos_id=cfg.bos_id, on_token=on_token)
    return _cut_at_stops(out, cfg)


def generating_families() -> list[str]:
    """Names of the registered families that decode with a KV cache."""
    return [name for name, family in FAMILIES.items() if family.generates]


def _cut_at_stops(out, cfg: SamplingConfig) -> list[list[int]]:
    results = []
    for row in np.asarray(out).tolist():
        for i, token in enumerate(row):
            if token in cfg.stop_tokens:
                row = row[: i + 1]
                break
        results.append(row)
    return results
