"""The most a training step can get from this machine's matmul engine, and what a target ratio
against PyTorch asks of it: the FLOPs a side-by-side shape's step must do, over the fastest
matmul each library runs here, measured in processes of their own.

    python benchmarks/ceiling.py --shape a --side-by-side benchmarks/results/X.json --rounds 3

Each round runs one JAX and one PyTorch process (alternating, each with its library's default
threads, as ``side_by_side.py`` runs them) that time square float32 and bfloat16 matmuls
and the shape's own forward weight products; the fastest of any of them is the peak. The
step's needed FLOPs count every weight matmul and, for attention, only the visible part of the
score matrix (a causal GPT needs ``(T+1)/2T`` of it; a tiled kernel that skips the masked tiles
comes close to that). So the ceiling is a bound relative to the fastest matmul measured, not
a prediction: a step that ran every needed FLOP at that rate, and did nothing else, would
train at ``peak / needed FLOPs per token``.

With ``--side-by-side`` (a ``side_by_side.py`` JSON of the same shape) it also reports, per
contender, the share of the peak its step reaches, and per target ratio of issue 17 (ours in
float32 1.5x the best PyTorch float32; ours in bfloat16 2x) the share of the peak that target
needs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import run_worker  # noqa: E402
from side_by_side_shared import SHAPES, emit, process_facts  # noqa: E402

DTYPES = ("float32", "bfloat16")
# Issue 17's targets: our contender -> (the dtype whose peak bounds it, the ratio it must reach
# against the fastest PyTorch contender, which trains in float32)
TARGETS = {"jax_float32": ("float32", 1.5), "jax_bfloat16": ("bfloat16", 2.0),
           # the same step as two concurrent row groups (train.concurrent_groups=2)
           "jax_float32_g2": ("float32", 1.5), "jax_bfloat16_g2": ("bfloat16", 2.0)}
TARGETS.update({f"{name}_reuse": t for name, t in TARGETS.items()})  # TJAX_HOST_MALLOC=reuse
TORCH_CONTENDERS = ("torch", "torch_compile", "hf")
KINDS = ("gpt", "bert")  # the side-by-side shapes' models: causal GPT-2, bidirectional BERT


def needed_flops_per_token(shape: dict) -> dict:
    """FLOPs per trained token (2 per multiply-add, x3 for forward and backward): the weight
    matmuls (4 C^2 for attention, 8 C^2 for a 4C-wide ungated MLP, the C x V output head and,
    for a BERT, its C x C head transform) and the attention products (scores and weighted sum,
    2 T C per token per layer over the full keys), counted whole (PaLM's MFU convention) and
    over the visible keys only (what the step must do). A BERT's head counts at every position,
    as the side-by-side contenders run it (gathering the masked 15% first would save about 2%
    of its FLOPs)."""
    if shape["kind"] not in KINDS:
        raise ValueError(f"shape kind {shape['kind']!r}: the FLOP count knows {KINDS}")
    c, t, layers = shape["width"], shape["train_len"], shape["layers"]
    bert = shape["kind"] == "bert"
    weights = layers * 12 * c * c + c * shape["vocab"] + (c * c if bert else 0)
    visible = 1.0 if bert else (t + 1) / (2 * t)  # causal: (T+1)/2T of the scores
    attention = layers * 2 * t * c
    return {"weights": 6.0 * weights, "attention_full": 6.0 * attention,
            "attention_visible": 6.0 * attention * visible,
            "needed": 6.0 * (weights + attention * visible),
            "palm_convention": 6.0 * (weights + attention)}


def dense_products(shape: dict) -> dict[str, tuple[int, int, int]]:
    """The step's own forward weight products ``[M, K] x [K, N]`` (M = batch x length): the
    attention projections, the MLP's two, and the output head."""
    m, c, v = shape["batch"] * shape["train_len"], shape["width"], shape["vocab"]
    return {"projection": (m, c, c), "mlp_up": (m, c, 4 * c), "mlp_down": (m, 4 * c, c),
            "head": (m, c, v)}


def _best_rate(matmul, make, dtype, mkn: tuple[int, int, int], repeats: int) -> float:
    m, k, n = mkn
    a, b = make((m, k), dtype), make((k, n), dtype)
    matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


def worker(library: str, sizes: list[int], repeats: int,
           products: dict[str, tuple[int, int, int]] | None = None) -> dict:
    """Best FLOP/s per dtype of an n x n x n matmul per size and of each named product, in
    this process (JAX asks for float32 accumulation; PyTorch's CPU bfloat16 matmul accumulates
    in float32 by itself)."""
    if library == "jax":
        import jax
        import jax.numpy as jnp

        product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        matmul = lambda x, y: product(x, y).block_until_ready()  # noqa: E731
        make = lambda s, d: jax.random.normal(jax.random.key(sum(s)), s, d)  # noqa: E731
        threads = None  # XLA sizes its pool to the CPUs allowed (cpus_allowed)
    else:
        import torch

        matmul = lambda x, y: torch.matmul(x, y)  # noqa: E731  (synchronous on CPU)
        make = lambda s, d: torch.randn(*s).to(getattr(torch, d))  # noqa: E731
        threads = torch.get_num_threads()
    rates = {d: {str(n): _best_rate(matmul, make, d, (n, n, n), repeats) for n in sizes}
             for d in DTYPES}
    own = {d: {name: _best_rate(matmul, make, d, mkn, repeats)
               for name, mkn in (products or {}).items()} for d in DTYPES}
    return {"library": library, "rates": rates, "products": own, "threads": threads,
            **process_facts()}


def measure(library: str, sizes: list[int], repeats: int, shape: str) -> dict:
    """One worker process of ``library`` (side_by_side.py's runner: the same environment,
    wall time and the share of the CPUs other processes took meanwhile)."""
    return run_worker(os.path.basename(__file__),
                      ["--worker", library, "--shape", shape, "--sizes", ",".join(map(str, sizes)),
                       "--repeats", str(repeats)],
                      lambda message: print(message, file=sys.stderr), timeout=900)


def _round_best(run: dict, dtype: str) -> float:
    """A round's fastest product in ``dtype``: the squares or the shape's own, whichever won."""
    return max([*run["rates"][dtype].values(), *run.get("products", {}).get(dtype, {}).values()])


def peaks_over_rounds(runs: list[dict]) -> dict:
    """Per library and dtype: the fastest product of any round (the peak), and the median over
    rounds of each round's fastest (how steady it was)."""
    out = {}
    for library in ("jax", "torch"):
        per_round = {d: [_round_best(r, d) for r in runs if r["library"] == library]
                     for d in DTYPES}
        out[library] = {d: {"best": max(v), "median": statistics.median(v), "per_round": v}
                        for d, v in per_round.items() if v}
    return out


def machine_peak(peaks: dict) -> dict[str, float]:
    """Per dtype, the faster library's peak: every share below is of this one."""
    return {d: max(p[d]["best"] for p in peaks.values() if d in p) for d in DTYPES}


def products_over_rounds(runs: list[dict], best: dict[str, float]) -> dict:
    """Per library, dtype and named product: its best rate over the rounds, and that as a share
    of the machine's peak in the dtype (how near it the step's own shapes run alone)."""
    out = {}
    for library in ("jax", "torch"):
        mine = [r["products"] for r in runs if r["library"] == library and r.get("products")]
        if not mine:
            continue
        out[library] = {}
        for d in DTYPES:
            rates = {name: max(r[d][name] for r in mine) for name in mine[0][d]}
            out[library][d] = {name: {"best": rate, "share_of_peak": rate / best[d]}
                               for name, rate in rates.items()}
    return out


def _per_round(side_by_side: dict, name: str) -> list[float]:
    return side_by_side["summary"]["per_contender"][name]["training_tokens_per_s"]["per_round"]


def against_contenders(side_by_side: dict, flops: dict, best: dict[str, float]) -> dict:
    """Each contender's share of the machine's peak of its dtype, and what each target asks:
    ratios are medians of per-round ratios (the rounds alternate, so a slow phase of the
    machine hits both sides of a ratio), as side_by_side.py computes its own."""
    speeds = {name: c["training_tokens_per_s"]["median"]
              for name, c in side_by_side["summary"]["per_contender"].items()
              if "training_tokens_per_s" in c}
    out = {"tokens_per_s": speeds, "share_of_peak": {}}
    for name, tokens_per_s in speeds.items():
        dtype = "bfloat16" if "bfloat16" in name else "float32"  # jax_bfloat16_g2 too
        out["share_of_peak"][name] = tokens_per_s * flops["needed"] / best[dtype]
    torch_speeds = {n: speeds[n] for n in TORCH_CONTENDERS if n in speeds}
    if not torch_speeds:
        out["targets"] = None
        out["note"] = f"no PyTorch contender ({', '.join(TORCH_CONTENDERS)}) in this run"
        return out
    fastest = max(torch_speeds, key=torch_speeds.get)
    out["fastest_pytorch"] = fastest
    out["targets"] = {}
    for ours, (dtype, ratio) in TARGETS.items():
        ceiling = best[dtype] / flops["needed"]
        entry = {"ratio": ratio, "peak_dtype": dtype,
                 "ceiling_ratio": ceiling / torch_speeds[fastest],
                 "share_of_peak_needed": ratio * torch_speeds[fastest] / ceiling}
        if ours in speeds:
            rounds = [a / b for a, b in zip(_per_round(side_by_side, ours),
                                             _per_round(side_by_side, fastest), strict=True)]
            entry["measured_ratio"] = {"median": statistics.median(rounds), "min": min(rounds),
                                       "max": max(rounds), "per_round": rounds}
        out["targets"][ours] = entry
    return out


def summarise(runs: list[dict], shape_name: str, side_by_side: dict | None,
              side_by_side_file: str | None) -> dict:
    """Everything but the run's own facts (command, date, load), from the workers' outputs."""
    shape = SHAPES[shape_name]
    flops = needed_flops_per_token(shape)
    peaks = peaks_over_rounds(runs)
    best = machine_peak(peaks)
    out = {"shape": {"name": shape_name, **shape}, "flops_per_token": flops,
           "peak_flops_per_s": peaks, "machine_peak_flops_per_s": best,
           "ceiling_tokens_per_s": {d: best[d] / flops["needed"] for d in DTYPES},
           "dense_products": {"shapes_mkn": dense_products(shape),
                              **products_over_rounds(runs, best)},
           "runs": runs}
    if side_by_side is not None:
        out["side_by_side"] = {"file": side_by_side_file, "date": side_by_side.get("date"),
                               **against_contenders(side_by_side, flops, best)}
    return out


def _read_json(parser, path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        parser.error(f"{what} {path!r}: {err}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="a")
    p.add_argument("--side-by-side", metavar="JSON",
                   help="a side_by_side.py result of the same shape: the contenders' speeds")
    p.add_argument("--rounds", type=int, default=3, help="JAX and PyTorch processes each")
    p.add_argument("--sizes", default="1024,2048", help="square matmul sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed products per size and dtype")
    p.add_argument("--reuse", metavar="JSON",
                   help="no new measurement: summarise the worker runs of an earlier output")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes {args.sizes!r}: give positive square matmul sizes like 1024,2048")
    if args.rounds < 1 or args.repeats < 1:
        p.error(f"--rounds {args.rounds} --repeats {args.repeats}: both must be at least 1")
    if args.worker:
        print(json.dumps(worker(args.worker, sizes, args.repeats,
                                dense_products(SHAPES[args.shape]))))
        return 0
    side_by_side = None
    if args.side_by_side:
        side_by_side = _read_json(p, args.side_by_side, "--side-by-side")
        if side_by_side.get("shape", {}).get("name") != args.shape or "summary" not in side_by_side:
            p.error(f"{args.side_by_side} is not a timed side_by_side.py run of shape "
                    f"{args.shape}: pass the matching --shape, and a run made without --check")
    load_start, earlier = list(os.getloadavg()), None
    if args.reuse:
        earlier = _read_json(p, args.reuse, "--reuse")
        runs = earlier["runs"]
    else:
        runs = [measure(library, sizes, args.repeats, args.shape)
                for _ in range(args.rounds) for library in ("jax", "torch")]
    result = {"command": " ".join(["python", "benchmarks/ceiling.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": load_start,
              "load_average_end": list(os.getloadavg()),
              **summarise(runs, args.shape, side_by_side, args.side_by_side)}
    if earlier is not None:  # the measurement's own date and load, not this summary's
        result["runs_from"] = {"file": args.reuse, **{k: earlier.get(k) for k in (
            "command", "date", "load_average_start", "load_average_end")}}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
