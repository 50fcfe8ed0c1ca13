"""``tjax bench``: one JSON object of training and decoding speed for a model config.

Training: tokens/s (median over timed steps after warm-up), model FLOPs per token, MFU against
the peak measured with a large matmul in the same dtype, compile time of the first step, and
memory (XLA's compiled buffer sizes, and the process's peak RSS). Decoding: tokens/s with the
KV cache at batch 1 and 8 (one compiled loop), and time to first token (prefill). Speed is
never asserted in tests: it is measured here and recorded with its command in BENCHMARKS.md.

    tjax bench                                   # config (a): 4x4x128, context 256, batch 16
    tjax bench --model.dtype=bfloat16 --steps 20
    tjax bench --model.n_layers=12 --model.n_heads=12 --model.d_model=768 --model.vocab_size=50257
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax import __version__
from transformers_jax.config import ModelConfig, TrainConfig, apply_overrides
from transformers_jax.models import build_model
from transformers_jax.nn.kvcache import init_cache
from transformers_jax.nn.layers import count_params
from transformers_jax.train.flops import flops_per_token, measure_matmul_peak
from transformers_jax.train.optim import learning_rate_schedule, make_optimizer
from transformers_jax.train.step import init_state, make_train_step

# Config (a) of the benchmark issue: a character-level GPT.
DEFAULT_MODEL = ModelConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=4, max_len=256,
                            position="learned", dropout=0.0)
DEFAULT_TRAIN = TrainConfig(batch_size=16, seq_len=256, steps=30, warmup_steps=1)


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def bench_training(model_cfg: ModelConfig, cfg: TrainConfig, steps: int, warmup: int = 3):
    model = build_model(model_cfg)
    optimizer = make_optimizer(cfg)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len),
                                    dtype=np.int32)}
    batch["targets"] = np.roll(batch["inputs"], -1, axis=1)
    state = init_state(model, optimizer, 0, batch)
    step_fn = jax.jit(make_train_step(model, optimizer, learning_rate_schedule(cfg)),
                      donate_argnums=0)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    for _ in range(warmup):
        state, _ = _timed(compiled, state, batch)[0]
    times = []
    for _ in range(steps):
        (state, _), seconds = _timed(compiled, state, batch)
        times.append(seconds)
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.seq_len
    flops = flops_per_token(model_cfg, cfg.seq_len)
    peak_dtype = "bfloat16" if model_cfg.dtype == "bfloat16" else "float32"
    peak = measure_matmul_peak(peak_dtype)
    return {
        "params": count_params(state.params),
        "tokens_per_s": tokens / median,
        "step_ms_median": 1e3 * median,
        "step_ms_min": 1e3 * min(times),
        "flops_per_token": flops,
        "peak_flops": peak,
        "peak_dtype": peak_dtype,
        "mfu": flops * tokens / median / peak,
        "compile_s": compile_s,
        "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
    }


def bench_decoding(model_cfg: ModelConfig, prompt_len: int = 16, new_tokens: int = 240,
                   batches=(1, 8), repeats: int = 3) -> dict:
    from transformers_jax.sample import SamplingConfig, _generate

    model = build_model(model_cfg)
    params = nn.meta.unbox(
        model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    )
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)
    total = prompt_len + new_tokens
    out = {}
    for batch in batches:
        prompts = jnp.ones((batch, prompt_len), jnp.int32)
        lengths = jnp.full((batch,), prompt_len, jnp.int32)
        prefill = jax.jit(lambda p, t, n, b=batch: model.apply(
            {"params": p}, t, cache=init_cache(model_cfg, b, total), lengths=n))

        def generate(p=prompts, n=lengths):
            return _generate(model, params, p, n, jax.random.key(0), cfg=greedy,
                             cache_size=total)

        _timed(prefill, params, prompts, lengths)  # compile
        ttft = min(_timed(prefill, params, prompts, lengths)[1] for _ in range(5))
        _timed(generate)  # compile
        run_s = min(_timed(generate)[1] for _ in range(repeats))
        out[f"batch_{batch}"] = {
            "decode_tokens_per_s": batch * new_tokens / run_s,
            "ms_per_step": 1e3 * run_s / new_tokens,
            "time_to_first_token_ms": 1e3 * ttft,
        }
    out["prompt_len"], out["new_tokens"] = prompt_len, new_tokens
    return out


def main(argv: list[str]) -> int:
    from transformers_jax.cli import parse_overrides

    overrides, _ = parse_overrides(argv)
    model_over = {k[6:]: v for k, v in overrides.items() if k.startswith("model.")}
    train_over = {k[6:]: v for k, v in overrides.items() if k.startswith("train.")}
    model_cfg = apply_overrides(DEFAULT_MODEL, model_over, "model.")
    cfg = apply_overrides(DEFAULT_TRAIN, train_over, "train.")
    result = {
        "model": {k: v for k, v in model_cfg.to_dict().items() if k != "rope"},
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "training": bench_training(model_cfg, cfg, steps=cfg.steps),
        "decoding": bench_decoding(model_cfg),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "versions": {"jax": jax.__version__, "transformers_jax": __version__,
                     "python": platform.python_version()},
    }
    print(json.dumps(result, indent=1))
    return 0
