"""Decoding speed: KV-cache decoding against recomputing the whole prefix for every token.

Prints one JSON object: time to first token (prefill), decode tokens/s at batch 1 and 8 (one
compiled loop), and the cost of one new token at growing prefix lengths with and without the
cache. Compilation is excluded from those timings (each function runs once before timing);
``new_settings`` times ``generate``'s first call and then calls with another temperature,
top-k and top-p, which run the program already compiled (what ``tjax sample`` and the lm-eval
adapter do when their settings change).

    python benchmarks/decode.py [--layers 4 --width 128 --heads 4 --new-tokens 240]
"""

from __future__ import annotations

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax import ModelConfig, build_model
from transformers_jax.bench import bench_decoding
from transformers_jax.nn.kvcache import init_cache
from transformers_jax.sample import SamplingConfig, generate


def best_time(fn, repeats: int = 5) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def time_new_settings(model, params, prompt: int, new_tokens: int) -> dict[str, float]:
    """Seconds of ``generate``'s first call (it compiles) and of calls with settings it has
    not seen: what changing the temperature or the filters costs."""
    settings = {"first_call_s": dict(temperature=0.8),
                "new_temperature_s": dict(temperature=0.9),
                "new_top_k_s": dict(temperature=0.9, top_k=20),
                "new_top_p_s": dict(temperature=0.9, top_p=0.95)}
    seconds = {}
    for name, values in settings.items():
        start = time.perf_counter()
        generate(model, params, [[1] * prompt], SamplingConfig(max_new_tokens=new_tokens,
                                                               **values))
        seconds[name] = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=262)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=240)
    parser.add_argument("--attention", default="xla")
    args = parser.parse_args()

    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.width, n_layers=args.layers,
                      n_heads=args.heads, attention=args.attention)
    model = build_model(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    result = {"config": {"layers": args.layers, "width": args.width, "heads": args.heads,
                         "vocab": args.vocab, "prompt": args.prompt,
                         "new_tokens": args.new_tokens, "attention": args.attention},
              "device": jax.devices()[0].device_kind, "jax": jax.__version__}

    result.update(bench_decoding(cfg, args.prompt, args.new_tokens))
    result["new_settings"] = time_new_settings(model, params, args.prompt, args.new_tokens)

    # One new token at prefix length L: cached step (cache of 1024 slots, L filled) versus a
    # full forward pass over the L-token prefix (what decoding without a cache repeats).
    step = jax.jit(lambda p, c, t: model.apply({"params": p}, t, c, method="decode_step"))
    full = jax.jit(lambda p, t: model.apply({"params": p}, t)[:, -1])
    per_length = []
    for length in (64, 128, 256, 512, 1024):
        tokens = jnp.ones((1, length), jnp.int32)
        cache = init_cache(cfg, 1, 1024)
        _, cache = step(params, cache, tokens[:, :-1])
        cached_s = best_time(lambda c=cache, t=tokens: step(params, c, t[:, -1:]))
        uncached_s = best_time(lambda t=tokens: full(params, t))
        per_length.append({"prefix": length, "cached_ms": 1e3 * cached_s,
                           "uncached_ms": 1e3 * uncached_s})
    result["per_token_by_prefix_length"] = per_length
    grow = per_length[-1]["uncached_ms"] / per_length[0]["uncached_ms"]
    flat = per_length[-1]["cached_ms"] / per_length[0]["cached_ms"]
    result["growth_64_to_1024"] = {"cached": flat, "uncached": grow}
    print(json.dumps(result, indent=2, default=lambda x: float(np.asarray(x))))


if __name__ == "__main__":
    main()
