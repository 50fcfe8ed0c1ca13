"""What attention costs in a training step, measured by taking it away: the same step with the
model's attention swapped for ``free``, which reads q, k and v and writes an output of the same
shape but computes no scores, no softmax and no products, timed alternately in one process.

    python benchmarks/attention_share.py                              # config a, float32
    python benchmarks/attention_share.py --model.dtype=bfloat16 --against 1.30
    python benchmarks/attention_share.py --model.family=bert --against 0.67   # config b

The step time ratio (with / without attention) bounds what any attention kernel could give
this step, however fast: it keeps the cost of reading attention's inputs and writing its
output once, which no kernel avoids. ``--against R``, a measured speed ratio of our step
against a peer (``side_by_side.py``), adds ``R x`` that bound: the most that ratio could
become with attention at no cost. The model and batch are ``tjax bench``'s (config a unless
``--preset``/``--model.*``/``--train.*`` say otherwise; ``--rounds`` and ``--steps`` say how
many steps, not ``--train.steps``). Prints one JSON object, with each
program's ``compile_s`` (tracing, lowering and XLA's compile, wall; the attention-free one is
compiled first, so the process's one-time costs fall on it).

``free`` is registered in the attention registry by this script's ``main`` only (a benchmark
device, not a model: the library never lists it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import spread  # noqa: E402

from transformers_jax.host_memory import relaunch_with_tunables  # noqa: E402


def free_attention(q, k, v, *, bias, mask, scale, logit_softcap):
    """``[B, T, H, D]``, ``[B, T, N, D]`` x 2 -> ``[B, T, H, D]``: each query head's key/value
    head values plus a small multiple of ``q - k``, so that q, k and v are each read once and
    get gradients (their projections stay in the step), with none of attention's work."""
    import jax.numpy as jnp

    del bias, mask, logit_softcap
    b, t, h, d = q.shape
    if k.shape[1] != t:
        raise ValueError(f"free attention is for self-attention: {t} queries, {k.shape[1]} "
                         "keys")
    group = h // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
    return (v + (q - k) * (scale or 1.0 / d**0.5)).astype(q.dtype)


def register_free() -> type:
    """Add ``free`` to the attention registry (this process only, once) and return its class."""
    from transformers_jax.nn.attention import AttentionImpl
    from transformers_jax.registry import ATTENTION

    if "free" in ATTENTION.names():
        return ATTENTION.get("free")

    @dataclasses.dataclass(frozen=True)
    class Free(AttentionImpl):
        kernel = staticmethod(free_attention)

    return ATTENTION.register("free")(Free)


def summarise(real_ms: list[float], free_ms: list[float], against: float | None) -> dict:
    """Per-round medians -> the step times, the speedup without attention (per round, then
    its spread), attention's share of the step and, given ``against``, the bound on it."""
    speedups = [r / f for r, f in zip(real_ms, free_ms, strict=True)]
    best = statistics.median(speedups)
    result = {"step_ms": {"with_attention": spread(real_ms), "attention_free": spread(free_ms)},
              "speedup_without_attention": spread(speedups),
              "attention_share_of_step": 1.0 - 1.0 / best}
    if against is not None:
        result["against"] = against
        result["bound_with_free_attention"] = against * best
    return result


def _timed_steps(compiled, state, batch, steps: int):
    import jax

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, _ = compiled(state, batch)
        jax.block_until_ready(state)
        times.append(1e3 * (time.perf_counter() - start))
    return state, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    p.add_argument("--against", type=float, default=None,
                   help="a measured ratio of our step's speed to a peer's, to bound")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be at least 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: must be at least 0")
    if args.against is not None and args.against <= 0:
        p.error(f"--against={args.against}: a speed ratio, must be positive")
    import jax
    from side_by_side_shared import emit, process_facts

    from transformers_jax import host_memory
    from transformers_jax.bench import bench_configs, bench_parser, training_setup

    model_cfg, cfg, bench_args, _ = bench_configs(rest)
    defaults = vars(bench_parser().parse([])[0])
    unused = [name for name, value in vars(bench_args).items()
              if name not in ("preset", "tiny") and value != defaults.get(name)]
    if unused:
        p.error(f"{', '.join('--' + n.replace('_', '-') for n in unused)}: tjax bench options "
                "this script does not use (it times training steps only); drop them")
    free = register_free()
    steps, compile_s, dot_generals = {}, {}, {}
    # free first: the process's one-time compile costs fall on it, not on the real step
    for name, attention in (("free", free()), ("real", model_cfg.attention)):
        step, state, batch = training_setup(model_cfg.replace(attention=attention), cfg)
        began = time.perf_counter()
        lowered = step.lower(state, batch)
        compiled = lowered.compile()
        compile_s[name] = time.perf_counter() - began
        dot_generals[name] = lowered.as_text().count("stablehlo.dot_general")
        for _ in range(args.warmup):
            state, _ = compiled(state, batch)
        steps[name] = [compiled, jax.block_until_ready(state), batch]
    start = process_facts()
    real_ms, free_ms = [], []
    for r in range(args.rounds):  # A B, then B A: a drift in the machine hits both alike
        for name in (("real", "free") if r % 2 == 0 else ("free", "real")):
            compiled, state, batch = steps[name]
            steps[name][1], ms = _timed_steps(compiled, state, batch, args.steps)
            (real_ms if name == "real" else free_ms).append(ms)
    emit({"model": model_cfg.to_dict(), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
          "concurrent_groups": cfg.concurrent_groups, "rounds": args.rounds,
          "steps_per_round": args.steps, **summarise(real_ms, free_ms, args.against),
          "compile_s": {"with_attention": compile_s["real"],
                        "attention_free": compile_s["free"]},
          # the matrix products each program was handed: the free one lacks attention's
          "dot_generals": {"with_attention": dot_generals["real"],
                           "attention_free": dot_generals["free"]},
          "host_malloc": host_memory.status(),
          "process_at_start": start, "load_average_at_end": list(os.getloadavg()),
          "jax": jax.__version__}, args.out)
    return 0


if __name__ == "__main__":
    relaunch_with_tunables()  # the malloc setting tjax runs with (BENCHMARKS.md section 2b)
    sys.exit(main())
