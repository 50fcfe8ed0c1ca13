"""Where a compiled training step (or greedy decoding loop) spends its time.

Traces a few executions with ``jax.profiler`` and sums the trace per XLA op by *self* time (a
loop's or a branch's time leaves out the ops run inside it), then groups it by op kind (the
name without its number: ``ynn_fusion``, ``copy``, ``subtract_exponential_fusion``, ...) and,
for the library matmul fusions and XLA's plain dots, by output shape. Prints one JSON object;
the model and batch are ``tjax bench``'s (config a unless ``--preset``/``--model.*``/
``--train.*`` say otherwise).

    python benchmarks/profile_step.py                      # config a's train step
    python benchmarks/profile_step.py --decode-batch 8     # its decoding loop at batch 8
    python benchmarks/profile_step.py --model.attention.unroll_tiles=0 --top 15

Times under the profiler run a little slower than without it: compare profiles with profiles.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from transformers_jax.host_memory import relaunch_with_tunables

# Not ops of the program: the executor, Python frames ("$..."), waits.
_NOT_OPS = re.compile(r"^\$|ThunkExecutor|PjitFunction|Await|^end: ")


def self_times(events: list[dict]) -> collections.Counter:
    """Microseconds of self time per event name: each complete event's duration less that of
    the events nested in it on the same thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    total = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        own, stack = [], []
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                stack.pop()
            entry = [e, e["dur"]]
            if stack:
                stack[-1][1] -= e["dur"]
            stack.append(entry)
            own.append(entry)
        for e, t in own:
            if not _NOT_OPS.search(e["name"]):
                total[e["name"]] += t
    return total


def output_shapes(hlo_text: str) -> dict[str, str]:
    """Top-level instruction name -> its output shape, from a compiled module's text."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^\s+(?:ROOT )?%([\w.\-]+) = (\S+) ", hlo_text, re.M)}


def summarise(counts: collections.Counter, shapes: dict[str, str], runs: int, top: int) -> dict:
    per_run = {name: t / runs for name, t in counts.items()}
    kinds, library, plain = collections.Counter(), collections.Counter(), collections.Counter()
    for name, t in per_run.items():
        kind = re.sub(r"\.\d+$", "", name)
        kinds[kind] += t
        if kind == "ynn_fusion":
            library[shapes.get(name, "?")] += t
        elif kind in ("dot", "dot_general"):  # XLA's own dot emitter (weight gradients)
            plain[shapes.get(name, "?")] += t
    ms = lambda c: [[k, round(v / 1e3, 3)] for k, v in c.most_common(top)]  # noqa: E731
    return {"self_ms_per_run": round(sum(per_run.values()) / 1e3, 3),
            "by_kind_ms": ms(kinds), "library_matmuls_by_output_shape_ms": ms(library),
            "plain_dots_by_output_shape_ms": ms(plain)}


def main(argv: list[str] | None = None) -> None:
    relaunch_with_tunables()  # the malloc setting tjax runs with (BENCHMARKS.md section 2b)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from transformers_jax.bench import bench_configs, training_setup

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-batch", type=int, default=None,
                   help="profile greedy decoding at this batch instead of a training step")
    p.add_argument("--runs", type=int, default=5, help="traced executions (after 3 untimed)")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    model_cfg, cfg, _, _ = bench_configs(rest)
    if args.decode_batch is None:
        step, state, batch = training_setup(model_cfg, cfg)
        compiled = step.lower(state, batch).compile()

        def run():
            nonlocal state
            state, _ = compiled(state, batch)
            return state
        what = {"training_step": {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len}}
    else:
        from transformers_jax.models import build_model
        from transformers_jax.sample import SamplingConfig, generate_tokens

        model = build_model(model_cfg)
        params = nn.meta.unbox(
            model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
        prompts = jnp.ones((args.decode_batch, 16), jnp.int32)
        lengths = jnp.full((args.decode_batch,), 16, jnp.int32)
        greedy = SamplingConfig(max_new_tokens=240, temperature=0.0)
        compiled = jax.jit(lambda params, p, n: generate_tokens(
            model, params, p, n, jax.random.key(0), cfg=greedy)).lower(
            params, prompts, lengths).compile()

        def run():
            return compiled(params, prompts, lengths)
        what = {"decoding": {"batch": args.decode_batch, "prompt": 16, "new_tokens": 240}}
    for _ in range(3):
        jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.runs):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        traces = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
        if not traces:
            raise SystemExit("profile_step: the profiler wrote no perfetto trace")
        with gzip.open(traces[0]) as f:
            events = json.load(f)["traceEvents"]
    summary = summarise(self_times(events), output_shapes(compiled.as_text()), args.runs,
                        args.top)
    print(json.dumps({**what, "model": model_cfg.to_dict(), "runs": args.runs, **summary,
                      "note": "self time per op (nested ops excluded), ms per execution, "
                              "under the profiler"}, indent=1))


if __name__ == "__main__":
    main()
