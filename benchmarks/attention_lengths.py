"""Attention alone, causal, forward + backward: how its memory grows with length (XLA's
compiled temporary bytes from 1k to 16k tokens; nothing is run) and its speed at short lengths
against ``xla`` and PyTorch's ``scaled_dot_product_attention``.

The PyTorch column runs in this process, alternating with JAX (torch with its default threads;
set ``OMP_WAIT_POLICY`` yourself if you want it). For a whole-model comparison with each side
in its own process see ``side_by_side.py``.

    python benchmarks/attention_lengths.py --speed-lengths ""     # memory only
    python benchmarks/attention_lengths.py --memory-lengths ""    # speed only
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.bench import emit_json, environment
from transformers_jax.registry import ATTENTION


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def attention_lengths(args, log) -> dict:
    """Attention alone, causal, forward + backward: compiled temporary bytes from 1k to 16k
    tokens (memory_analysis; nothing is run) and speed at short lengths against xla and torch's
    ``scaled_dot_product_attention`` (4 heads of 32: the default benchmark model's attention)."""
    import torch

    from transformers_jax.nn.attention import dot_product_attention
    from transformers_jax.nn.masks import build_mask

    heads, dim = 4, 32

    def grad_fn(impl, chunk):
        def loss(q, k, v, pos):
            mask = build_mask("causal", pos, pos)
            out = dot_product_attention(q, k, v, mask=mask, implementation=impl,
                                        chunk_size=chunk)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    kernels = {"xla": ("xla", 128), "reference": ("reference", 128),
               "chunked_64": ("chunked", 64), "chunked_128": ("chunked", 128)}
    memory = []
    for length in args.memory_lengths:
        spec = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32)
        pos = jax.ShapeDtypeStruct((1, length), jnp.int32)
        row = {"length": length, "one_score_matrix_bytes": 4 * heads * length * length}
        for name, (impl, chunk) in kernels.items():
            if ATTENTION.get(impl).oracle and length > 4096:  # the oracle: as xla up to 4096
                continue
            compiled = grad_fn(impl, chunk).lower(spec, spec, spec, pos).compile()
            row[f"{name}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
        memory.append(row)
        log(f"  memory at {length}: " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in row.items() if k.endswith("bytes")))
    speed = []
    rng = np.random.default_rng(5)
    for length in args.speed_lengths:
        batch = max(4096 // length, 1)
        q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
                   for _ in range(3))
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        fns = {name: grad_fn(impl, chunk) for name, (impl, chunk) in kernels.items()
               if not ATTENTION.get(impl).oracle}
        tq, tk, tv = (torch.tensor(np.asarray(x).transpose(0, 2, 1, 3), requires_grad=True)
                      for x in (q, k, v))

        def torch_sdpa(tq=tq, tk=tk, tv=tv):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            (out**2).sum().backward()

        contenders = {name: (lambda f=f, a=(q, k, v, pos): jax.block_until_ready(f(*a)))
                      for name, f in fns.items()}
        contenders["torch_sdpa"] = torch_sdpa
        for fn in contenders.values():
            fn()
        times = {name: [] for name in contenders}
        for _ in range(args.attention_repeats):
            for name, fn in contenders.items():
                times[name].append(timed(fn)[0])
        row = {"length": length, "batch": batch}
        row.update({f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in times.items()})
        for name in ("chunked_64", "chunked_128", "torch_sdpa"):
            row[f"{name}_speedup_vs_xla"] = row["xla_ms"] / row[f"{name}_ms"]
        speed.append(row)
        log(f"  speed at {length}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms")))
    return {"heads": heads, "head_dim": dim, "mask": "causal", "dtype": "float32",
            "memory_forward_backward": memory, "speed_forward_backward_4096_tokens": speed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--speed-lengths", default="128,256,512,1024")
    parser.add_argument("--attention-repeats", type=int, default=15)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    args.memory_lengths = [int(x) for x in filter(None, args.memory_lengths.split(","))]
    args.speed_lengths = [int(x) for x in filter(None, args.speed_lengths.split(","))]

    def log(message):
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {message}",
                  file=sys.stderr, flush=True)

    result = {"command": "python benchmarks/attention_lengths.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              **environment()}
    if args.speed_lengths:
        import torch

        result["torch"] = {"version": torch.__version__, "threads": torch.get_num_threads()}
    result["attention_lengths"] = attention_lengths(args, log)
    result["load_average_end"] = list(os.getloadavg())
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
