"""One-command accelerator benchmark: GPT-2 small shape, bfloat16, cuDNN attention, context 1024.

    python benchmarks/gpu.py                 # on a GPU: under 10 minutes, prints one JSON object
    python benchmarks/gpu.py --tiny          # anywhere (CPU): a toy size, the same code paths

What it does, in order:

1. Builds GPT-2 small (12 layers, 12 heads, width 768, vocab 50257, learned positions, tied,
   gelu, layernorm) computing in bfloat16 with float32 master parameters and float32
   accumulation, with ``attention=cudnn`` (``--attention`` to change; on a machine without a
   GPU ``--tiny`` uses ``chunked``).
2. Finds the largest batch that fits: compiles the train step at a probe batch, reads XLA's
   compiled memory (arguments + temporaries + outputs), extrapolates the per-row cost to the
   device's byte limit, then compiles and runs the predicted batch, stepping down 15% at a time
   on an out-of-memory error. Every probe is listed in the JSON.
3. Times training at that batch: tokens/s (median of ``--steps`` after warm-up), model FLOPs
   per token, MFU against the datasheet bf16 peak of the GPU (``learning/flops.py``) and against a
   measured bf16 matmul.
4. Times decoding with the KV cache at batch 1 and 8 (greedy, one compiled loop) and the time
   to first token; decoding attention is ``--decode-attention`` (xla: cuDNN's fused kernel
   targets long queries, a decode step has one).

Set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` yourself to change how much GPU memory JAX takes (this
script sets 0.95 when it is unset, so the batch search sees most of the card).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformers_jax.bench import (  # noqa: E402
    bench_decoding,
    datasheet_peak,
    emit_json,
    environment,
)
from transformers_jax.config import ModelConfig, TrainConfig  # noqa: E402
from transformers_jax.learning.flops import flops_per_token, measure_matmul_peak  # noqa: E402
from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from transformers_jax.learning.step import init_state, make_train_step  # noqa: E402
from transformers_jax.models import build_model  # noqa: E402
from transformers_jax.nn.layers import count_params  # noqa: E402
from transformers_jax.registry import ATTENTION  # noqa: E402

GPT2_SMALL = dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_len=1024,
                  position="learned", mlp="gelu", norm="layernorm", tie_embeddings=True,
                  dropout=0.0, dtype="bfloat16", param_dtype="float32")
TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_len=64,
            position="learned", mlp="gelu", norm="layernorm", tie_embeddings=True,
            dropout=0.0, dtype="bfloat16", param_dtype="float32")


def is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


class Trainer:
    """A compiled train step at one batch size (compiling is what the search pays for)."""

    def __init__(self, model_cfg: ModelConfig, batch: int, seq_len: int):
        self.tokens = batch * seq_len
        cfg = TrainConfig(batch_size=batch, seq_len=seq_len, steps=1000, warmup_steps=10)
        model = build_model(model_cfg)
        optimizer = make_optimizer(cfg)
        rng = np.random.default_rng(0)
        inputs = rng.integers(0, model_cfg.vocab_size, (batch, seq_len), dtype=np.int32)
        self.batch = {"inputs": jnp.asarray(inputs),
                      "targets": jnp.asarray(np.roll(inputs, -1, axis=1))}
        self.state = init_state(model, optimizer, 0, self.batch)
        step = jax.jit(make_train_step(model, optimizer, learning_rate_schedule(cfg)),
                       donate_argnums=0)
        start = time.perf_counter()
        self.compiled = step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.bytes = None
        if memory is not None:
            self.bytes = {k: getattr(memory, f"{k}_size_in_bytes", 0)
                          for k in ("argument", "temp", "output", "alias")}

    def step(self):
        self.state, metrics = self.compiled(self.state, self.batch)
        return jax.block_until_ready(metrics["loss"])

    def needed_bytes(self) -> int | None:
        if self.bytes is None:
            return None
        b = self.bytes
        return b["argument"] + b["temp"] + b["output"] - b["alias"]


def device_limit(budget: int | None) -> int | None:
    if budget:
        return budget
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def find_batch(model_cfg, seq_len: int, probe: int, limit: int | None, max_batch: int, log):
    """The largest batch that compiles and runs (within ``limit`` bytes when given)."""
    probes = []

    def attempt(batch):
        entry = {"batch": batch}
        probes.append(entry)
        try:
            trainer = Trainer(model_cfg, batch, seq_len)
            entry["compile_s"] = trainer.compile_s
            entry["needed_bytes"] = trainer.needed_bytes()
            if limit is not None and entry["needed_bytes"] and entry["needed_bytes"] > limit:
                entry["fits"] = False
                entry["why"] = "compiled memory above the limit"
                return None
            trainer.step()
            entry["fits"] = True
            return trainer
        except Exception as err:  # XlaRuntimeError and friends: only OOM is expected
            if not is_oom(err):
                raise
            entry["fits"] = False
            entry["why"] = str(err).splitlines()[0][:200]
            return None

    trainer = attempt(probe)
    if trainer is None:
        while trainer is None and probe > 1:
            probe = max(probe // 2, 1)
            trainer = attempt(probe)
        if trainer is None:
            raise RuntimeError(f"not even batch 1 fits; probes: {probes}")
        return trainer, probes
    best = trainer
    if limit is not None and trainer.needed_bytes():
        fixed = trainer.bytes["argument"]  # parameters, optimizer state, the batch
        per_row = max(trainer.needed_bytes() - fixed, 1) / probe
        guess = int((limit * 0.97 - fixed) / per_row)
        guess = min(max_batch, max(guess - guess % 8 if guess >= 16 else guess, probe))
        log(f"probe batch {probe}: {trainer.needed_bytes() / 2**30:.2f} GiB; predicted "
            f"largest batch {guess} (limit {limit / 2**30:.1f} GiB)")
        while guess > probe:
            del trainer
            candidate = attempt(guess)
            if candidate is not None:
                return candidate, probes
            guess = int(guess * 0.85)
        return Trainer(model_cfg, probe, seq_len), probes
    return best, probes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy model and memory budget")
    parser.add_argument("--attention", default=None, help="training attention (default cudnn)")
    parser.add_argument("--decode-attention", default="xla")
    parser.add_argument("--seq-len", type=int, default=None, help="context (default 1024)")
    parser.add_argument("--probe-batch", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--memory-budget", type=int, default=None,
                        help="bytes the batch may use (default: the device's limit)")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps")
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    tiny = args.tiny
    attention = args.attention or ("chunked" if tiny and backend != "gpu" else "cudnn")
    runs_on = ATTENTION.get(attention).backends
    if backend not in runs_on:
        raise SystemExit(f"benchmarks/gpu.py: attention={attention} runs on {', '.join(runs_on)} "
                         f"(backend is {backend!r}); run with --tiny, or pass --attention chunked")
    fields = dict(TINY if tiny else GPT2_SMALL)
    seq_len = args.seq_len or (32 if tiny else 1024)
    fields["max_len"] = max(fields["max_len"], seq_len)
    model_cfg = ModelConfig(attention=attention, **fields)
    if hasattr(model_cfg.attention, "chunk_size"):  # a tiled kernel: tiles of at most 64
        model_cfg = model_cfg.replace(attention=dataclasses.replace(
            model_cfg.attention, chunk_size=min(64, seq_len)))
    budget = args.memory_budget or (64 * 2**20 if tiny else None)
    steps = args.steps or (3 if tiny else 10)

    def log(message):
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    limit = device_limit(budget)
    log(f"{jax.devices()[0].device_kind}: searching the largest batch at context {seq_len}")
    trainer, probes = find_batch(model_cfg, seq_len, args.probe_batch or (2 if tiny else 8),
                                 limit, 16 if tiny else args.max_batch, log)
    batch = trainer.tokens // seq_len
    log(f"batch {batch}: timing {steps} steps")
    for _ in range(2):
        trainer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = flops_per_token(model_cfg, seq_len)
    achieved = flops * trainer.tokens / median
    sheet, kind = datasheet_peak()
    measured = measure_matmul_peak("bfloat16", n=512 if tiny else 8192)
    training = {
        "params": count_params(trainer.state.params),
        "batch_size": batch,
        "seq_len": seq_len,
        "tokens_per_s": trainer.tokens / median,
        "step_ms_median": 1e3 * median,
        "step_ms_min": 1e3 * min(times),
        "timed_steps": steps,
        "flops_per_token": flops,
        "achieved_flops_per_s": achieved,
        "datasheet_bf16_peak": sheet,
        "mfu_vs_datasheet_bf16": None if sheet is None else achieved / sheet,
        "measured_bf16_matmul_peak": measured,
        "mfu_vs_measured_bf16": achieved / measured,
        "compile_s": trainer.compile_s,
        "compiled_bytes": trainer.bytes,
        "memory_limit_bytes": limit,
        "batch_search": probes,
    }
    del trainer
    decode_cfg = model_cfg.replace(attention=args.decode_attention)
    new_tokens = args.decode_tokens or (12 if tiny else 256)
    log(f"decoding {new_tokens} tokens at batch 1 and 8 ({args.decode_attention} attention)")
    decoding = bench_decoding(decode_cfg, prompt_len=16 if not tiny else 4,
                              new_tokens=new_tokens, batches=(1, 8))
    result = {
        "benchmark": "benchmarks/gpu.py" + (" --tiny" if tiny else ""),
        "model": model_cfg.to_dict(),
        "training": training,
        "decoding": decoding,
        "decode_attention": args.decode_attention,
        "device_memory": jax.devices()[0].memory_stats() if backend != "cpu" else None,
        "wall_s": time.perf_counter() - started,
        **environment(),
    }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
