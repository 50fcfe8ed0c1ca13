"""Sampling with the KV cache: prefill the prompts in one pass, then decode in one compiled loop.

Greedy, temperature, top-k and top-p (nucleus) sampling, stop tokens, a batch of prompts of
different lengths. Randomness enters only through the sampling key: greedy decoding is
deterministic.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from transformers_jax import backends
from transformers_jax.backends.generic import Backend
from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.models import FAMILIES, family_of
from transformers_jax.nn.kvcache import KVCache, check_decoding

NEG_INF = -1e30


class SamplingValues(NamedTuple):
    """The settings that reach the compiled decoder as values, not as part of its shape: any
    temperature, top-k or top-p runs the program already compiled (scalars, one per batch)."""

    temperature: jax.Array  # float32 (greedy decoding is its own program and ignores it)
    top_k: jax.Array  # int32; 0 keeps every token
    top_p: jax.Array  # float32; 1 keeps every token


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
        for name in ("max_new_tokens", "top_k"):  # the wrong type would fail deep in JAX
            value = getattr(self, name)
            if not (value is None and name == "top_k") and (
                    not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise ValueError(f"{name}={value!r}: must be an integer")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is None and name == "top_p":
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: must be a finite number")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be positive")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k={self.top_k}: must be a positive integer or None")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1] or None")

    def values(self) -> SamplingValues:
        """Temperature, top-k and top-p as the values the compiled decoder takes (NumPy
        scalars: no device is touched, so a compile-only TPU mesh can lower the decoder)."""
        return SamplingValues(np.float32(self.temperature), np.int32(self.top_k or 0),
                              np.float32(1.0 if self.top_p is None else self.top_p))

    def shape(self) -> SamplingConfig:
        """What the decoder is compiled for: these settings less the values (``values``), so
        that every temperature, top-k and top-p shares one program. Greedy decoding
        (temperature 0) is a program of its own: a branch between the two in every step
        would slow greedy decoding by a tenth on a CPU."""
        return replace(self, temperature=0.0 if self.temperature == 0 else 1.0, top_k=None,
                       top_p=None)


def filter_logits(logits_BV: jax.Array, top_k, top_p) -> jax.Array:
    """Set every token outside the top-k / nucleus to -inf (the most likely is always kept).
    ``top_k`` and ``top_p`` may be traced; None (or 0 and 1) keeps every token."""
    V = logits_BV.shape[-1]
    k = jnp.asarray(0 if top_k is None else top_k, jnp.int32)
    k = jnp.where((k <= 0) | (k > V), V, k)
    p = jnp.asarray(1.0 if top_p is None else top_p, jnp.float32)
    order_BV = jnp.argsort(-logits_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    # top-k keeps every token tied with the k-th largest
    kth_B1 = jax.lax.dynamic_index_in_dim(sorted_BV, k - 1, axis=-1, keepdims=True)
    sorted_BV = jnp.where(sorted_BV < kth_B1, NEG_INF, sorted_BV)
    # the nucleus, among those: keep a token while the mass strictly before it is below top_p
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_sorted_BV = (sorted_BV > NEG_INF) & ((before_BV < p) | (p >= 1.0))
    keep_BV = jnp.zeros_like(keep_sorted_BV).at[
        jnp.arange(logits_BV.shape[0])[:, None], order_BV
    ].set(keep_sorted_BV)
    return jnp.where(keep_BV, logits_BV, NEG_INF)


def choose_tokens(logits_BV: jax.Array, key: jax.Array, values: SamplingValues,
                  greedy: bool = False) -> jax.Array:
    """Next token per row, ``[B]`` int32: the argmax when ``greedy``, else a draw at
    ``values.temperature`` from the top-k / nucleus, which a ``lax.cond`` skips (the sort
    and all) when neither filter is set."""
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    scaled_BV = logits_BV / values.temperature
    filtered_BV = jax.lax.cond(
        (values.top_k > 0) | (values.top_p < 1.0),
        lambda x: filter_logits(x, values.top_k, values.top_p), lambda x: x, scaled_BV)
    return jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)


def check_decode_length(config: ModelConfig, total_len: int) -> None:
    limit = config.position.max_length(config)
    if limit is not None and total_len > limit:
        raise ValueError(
            f"prompt plus max_new_tokens is {total_len} tokens, longer than "
            f"position={config.position.name} allows ({config.position.limit_text(config)}); "
            "shorten the prompt or max_new_tokens"
        )


def room_for_new_tokens(config: ModelConfig, prompt_len: int) -> int | None:
    """The most tokens the model can generate after a prompt of ``prompt_len`` tokens (None:
    no limit): a decoder's prompt and new tokens share its positions, a seq2seq decoder
    starts from bos at position 0."""
    limit = config.position.max_length(config)
    if limit is None:
        return None
    return limit - prompt_len if family_of(config).continues_prompt else limit - 1


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, multiple: int = 16):
    """Right-pad to a common length (rounded up, so few shapes compile): ([B, P], lengths)."""
    if not prompts:
        raise ValueError("no prompt to continue (an empty batch of prompts)")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use bos for an empty prompt)")
    width = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, np.array([len(p) for p in prompts], np.int32)


def _decode_loop(step_fn, first_logits_BV, cache, key, cfg: SamplingConfig,
                 values: SamplingValues, on_token):
    """Sample the first token from ``first_logits_BV``, then loop (``lax.while_loop``) on
    ``step_fn(cache, tokens_B) -> (logits_BV, cache)`` until ``max_new_tokens`` or every row
    has emitted a stop token; rows that stopped get ``pad_id``. Returns ``[B, max_new]``."""
    B = first_logits_BV.shape[0]
    stops = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
    greedy = cfg.temperature == 0.0

    def emit(step, token_B, done_B):
        token_B = jnp.where(done_B, cfg.pad_id, token_B)
        if on_token is not None:
            io_callback(on_token, None, step, token_B, done_B, ordered=True)
        return token_B, done_B | jnp.isin(token_B, stops)

    key, sub = jax.random.split(key)
    first_B, done_B = emit(0, choose_tokens(first_logits_BV, sub, values, greedy),
                           jnp.zeros((B,), bool))
    out_BN = jnp.full((B, cfg.max_new_tokens), cfg.pad_id, jnp.int32).at[:, 0].set(first_B)

    def cond(carry):
        step, _, _, done_B, _, _ = carry
        return (step < cfg.max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        step, token_B, cache, done_B, out_BN, key = carry
        logits_BV, cache = step_fn(cache, token_B)
        key, sub = jax.random.split(key)
        token_B, new_done = emit(step, choose_tokens(logits_BV, sub, values, greedy), done_B)
        out_BN = out_BN.at[:, step].set(token_B)
        return step + 1, token_B, cache, new_done, out_BN, key

    carry = (jnp.int32(1), first_B, cache, done_B, out_BN, key)
    return jax.lax.while_loop(cond, body, carry)[4]


def prefill(model, params, prompts_BP: jax.Array, lengths_B: jax.Array, max_new_tokens: int,
            bos_id: int | None = None) -> tuple[jax.Array, KVCache]:
    """Start decoding right-padded prompts ``[B, P]`` (``lengths_B`` real tokens each):
    ``(logits [B, V] of the first new token, cache)``. A decoder-only model runs the prompts
    through the cache; an encoder-decoder encodes them and starts its decoder from ``bos_id``.
    The same call for every generating family (each model has ``init_cache`` and ``prefill``).
    """
    B, P = prompts_BP.shape
    cache = model.init_cache(B, P, max_new_tokens)
    return model.apply({"params": params}, prompts_BP, lengths_B, cache, bos_id=bos_id,
                       method="prefill")


def decode_step(model, params, tokens_B: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row through the cache: ``(logits [B, V], new cache)``."""
    logits_B1V, cache = model.apply({"params": params}, tokens_B[:, None], cache,
                                    method="decode_step")
    return logits_B1V[:, 0], cache


def _generate_tokens(model, params, prompts_BP: jax.Array, lengths_B: jax.Array, key: jax.Array,
                     values: SamplingValues, *, cfg: SamplingConfig,
                     on_token: Callable | None = None) -> jax.Array:
    first_BV, cache = prefill(model, params, prompts_BP, lengths_B, cfg.max_new_tokens,
                              bos_id=cfg.bos_id)
    def step_fn(cache, tokens_B):
        return decode_step(model, params, tokens_B, cache)

    return _decode_loop(step_fn, first_BV, cache, key, cfg, values, on_token)


_STATIC = ("model", "cfg", "on_token")
_generate_nested = jax.jit(_generate_tokens, static_argnames=_STATIC)
_TOP_LEVEL: dict[str, Callable] = {}  # platform -> the decoder compiled with its options


def _generate_top_level(backend: Backend) -> Callable:
    """The decoder as a program of its own, compiled with ``backend``'s decoding options."""
    if backend.platform not in _TOP_LEVEL:
        _TOP_LEVEL[backend.platform] = jax.jit(
            _generate_tokens, static_argnames=_STATIC,
            compiler_options=dict(backend.programs.decode_compiler_options) or None)
    return _TOP_LEVEL[backend.platform]


def generate_tokens(model, params, prompts_BP: jax.Array, lengths_B: jax.Array, key: jax.Array,
                    *, cfg: SamplingConfig, on_token: Callable | None = None) -> jax.Array:
    """The compiled decoder: prefill, then one compiled loop of ``decode_step``; returns the
    new tokens ``[B, max_new_tokens]`` (``pad_id`` after a row stops). What ``generate`` and
    the benchmarks run. Temperature, top-k and top-p reach the program as values
    (``SamplingConfig.values``), so a new setting runs the program already compiled (greedy
    decoding has one of its own: ``SamplingConfig.shape``).

    Called on arrays it compiles with the decoding options of the backend compiled for
    (``backends.current()``: the mesh in context, else JAX's default backend; XLA:CPU keeps
    the loop's small passes on one thread, ``backends/cpu.py``); called inside a caller's
    ``jit`` (its arguments traced) it becomes part of that program, which JAX compiles with
    the caller's options (JAX takes compile options on the outermost ``jit`` only).
    ``generate_tokens.lower`` (``trace``, ``eval_shape``) lowers the top-level version."""
    nested = _inside_a_trace(params, prompts_BP, lengths_B, key)
    run = _generate_nested if nested else _generate_top_level(backends.current())
    return run(model, params, prompts_BP, lengths_B, key, cfg.values(), cfg=cfg.shape(),
               on_token=on_token)


def _inside_a_trace(*args) -> bool:
    """Whether JAX is tracing (a caller's ``jit``, ``scan``, ``vmap``, ``eval_shape``...), even
    when every argument is a closed-over constant. ``trace_state_clean`` is private: a JAX
    without it falls back to asking whether any argument is traced."""
    try:
        from jax._src.core import trace_state_clean
    except ImportError:
        return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return not trace_state_clean()


def _top_level_method(name: str) -> Callable:
    def method(*args, cfg: SamplingConfig, **kwargs):
        jitted = _generate_top_level(backends.current())
        return getattr(jitted, name)(*args, cfg.values(), cfg=cfg.shape(), **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` of the top-level decoder for the backend compiled for."
    return method


def _clear_caches() -> None:
    for jitted in (_generate_nested, *_TOP_LEVEL.values()):
        jitted.clear_cache()


# what a jitted function offers, from the top-level version
for _name in ("lower", "trace", "eval_shape"):
    setattr(generate_tokens, _name, _top_level_method(_name))
generate_tokens.clear_cache = _clear_caches
generate_tokens.__wrapped__ = _generate_tokens  # the undecorated function, as jax.jit keeps it


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
    check_generates(model_cfg)
    if family.generates == "seq2seq" and cfg.bos_id is None:
        raise ValueError("an encoder-decoder starts decoding from bos: set SamplingConfig.bos_id")
    # A learned table has no rows for padding past it: pad exactly then; else to a multiple
    # of 16 so that few prompt shapes compile.
    limited = model_cfg.position.max_length(model_cfg) is not None
    tokens, lengths = pad_prompts(prompts, cfg.pad_id, multiple=1 if limited else 16)
    decoded = (int(lengths.max()) + cfg.max_new_tokens if family.continues_prompt
               else max(int(lengths.max()), cfg.max_new_tokens + 1))
    check_decode_length(model_cfg, decoded)
    check_cache_fits(model, *tokens.shape, cfg.max_new_tokens)
    out = generate_tokens(model, params, jnp.asarray(tokens), jnp.asarray(lengths),
                          jax.random.key(seed), cfg=cfg, on_token=on_token)
    return _cut_at_stops(out, cfg)


def cache_bytes(model, batch: int, prompt_len: int, max_new_tokens: int) -> int:
    """Bytes of the KV cache ``prefill`` builds for this request (from shapes; nothing is
    allocated)."""
    shapes = jax.eval_shape(lambda: model.init_cache(batch, prompt_len, max_new_tokens))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def free_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes free on ``device`` (default: JAX's first): the allocator's limit less what is in
    use on an accelerator, the host's available memory on CPU; None where neither is known."""
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_cache_fits(model, batch: int, prompt_len: int, max_new_tokens: int,
                     free_bytes: int | None = None) -> None:
    """Refuse, before any work, a request whose KV cache would not fit in the memory free on
    the device (``free_memory_bytes`` unless given), saying how long a row can be. The cache
    lives on one device: splitting it over chips is not built."""
    need = cache_bytes(model, batch, prompt_len, max_new_tokens)
    free = free_memory_bytes() if free_bytes is None else free_bytes
    if free is None or need <= free:
        return
    extra = 256  # the cache's growth per token a row, measured on a longer request
    per_token = (cache_bytes(model, batch, prompt_len, max_new_tokens + extra) - need) / extra
    length = prompt_len + max_new_tokens
    if per_token > 0:
        most = max(int((free - (need - per_token * length)) / per_token), 0)
        limit = (f"at most about {most:,} tokens a row (prompt and new tokens together) fit; "
                 "shorten the prompts or --max-new-tokens, or sample fewer rows at once")
    else:  # a ring cache (sliding window): its size does not grow with the length
        limit = "its size does not depend on the length; sample fewer rows at once"
    raise ConfigError(
        f"sampling {batch} rows of {prompt_len} prompt + {max_new_tokens} new tokens needs a "
        f"KV cache of {need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on "
        f"this device: {limit}")


def check_generates(config: ModelConfig) -> None:
    """Refuse, before any work, a model that cannot generate with a KV cache: its family, or
    its mask, positions or kernel (``check_decoding``); the message says what works."""
    if not family_of(config).generates:
        raise ConfigError(f"family={config.family!r} cannot generate with a KV cache; "
                          f"sampling is for {', '.join(generating_families())} models")
    check_decoding(config)


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
