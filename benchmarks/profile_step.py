"""Where a compiled training step (or greedy decoding loop) spends its time.

Traces a few executions with ``jax.profiler`` and sums the trace per XLA op by *self* time (a
loop's or a branch's time leaves out the ops run inside it), then groups it by op kind (the
name without its number: ``ynn_fusion``, ``copy``, ``subtract_exponential_fusion``, ...) and,
for the library matmul fusions and XLA's plain dots, by output shape. Prints one JSON object;
the model and batch are ``tjax bench``'s (its default unless ``--preset``/``--model.*``/
``--train.*`` say otherwise).

    python benchmarks/profile_step.py                      # config a's train step
    python benchmarks/profile_step.py --decode-batch 8     # its decoding loop at batch 8
    python benchmarks/profile_step.py --model.attention.unroll_tiles=0 --top 15
    python benchmarks/profile_step.py --compile           # where the step's compile goes

Times under the profiler run a little slower than without it: compare profiles with profiles.

``--compile`` traces the XLA compile of the training step instead: the wall time of tracing,
lowering and compiling; XLA's phases (its HLO passes, the kernel compiles of its fusions,
LLVM's code generation, the thunk emission; inclusive wall ms, summed over threads where they
run in parallel); and the kernel compiles by the part of the model each fusion comes from
(its ``op_name``), since XLA:CPU compiles each distinct fusion on its own.
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

from transformers_jax.backends import prepare_host

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


# XLA:CPU's compile phases, as its trace names them (a name starts with one of these)
COMPILE_PHASES = ("HLO passes through layout assignment", "HLO passes after layout assignment",
                  "FusionCompiler::Compile", "JitCompiler::Compile",
                  "ThunkEmitter::EmitEntryComputation", "ThunkEmitter::ConsumeKernels")
_PARTS = ("attention", "mlp", "norm", "embed", "head")


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` metadata, in every computation of a module's text."""
    names = {}
    for m in re.finditer(r"^\s+(?:ROOT )?%([\w.\-]+) = .*$", hlo_text, re.M):
        found = re.search(r'op_name="([^"]*)"', m.group(0))
        names[m.group(1)] = found.group(1) if found else ""
    return names


def model_part(op_name: str) -> str:
    """``"forward attention"``, ``"backward mlp"``, ...; ``"optimizer and step"`` for what is
    neither (the update, the gradient norm, the RNG); ``"unnamed"`` without metadata."""
    if not op_name:
        return "unnamed"
    direction = ("backward" if "transpose(" in op_name
                 else "forward" if "jvp(" in op_name else None)
    if direction is None:
        return "optimizer and step"
    part = next((p for p in _PARTS if re.search(rf"/[\w.]*{p}", op_name)), "other")
    return f"{direction} {part}"


def compile_anatomy(events: list[dict], hlo_text: str, top: int) -> dict:
    """XLA's compile phases (inclusive wall ms and counts) and its kernel compiles by model
    part, from a trace of one compile."""
    phases = collections.Counter()
    counts = collections.Counter()
    kernels = collections.Counter()
    kernel_counts = collections.Counter()
    names = op_names(hlo_text)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        phase = next((p for p in COMPILE_PHASES if e["name"].startswith(p)), None)
        if phase is None:
            continue
        phases[phase] += e["dur"]
        counts[phase] += 1
        if phase == "FusionCompiler::Compile":
            module = (e.get("args") or {}).get("module", "")
            fusion = re.sub(r"_kernel_module$", "", re.sub(r"^__compute_module_", "", module))
            part = model_part(names.get(fusion, ""))
            kernels[part] += e["dur"]
            kernel_counts[part] += 1
    return {
        "phases_ms": {p: round(phases[p] / 1e3, 1) for p in COMPILE_PHASES},
        "phase_counts": {p: counts[p] for p in COMPILE_PHASES},
        "kernel_compiles_by_part": [
            {"part": part, "kernels": kernel_counts[part], "ms": round(t / 1e3, 1)}
            for part, t in kernels.most_common(top)],
    }


def trace_events(trace_dir: str) -> list[dict]:
    traces = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
    if not traces:
        raise SystemExit("profile_step: the profiler wrote no perfetto trace")
    with gzip.open(traces[0]) as f:
        return json.load(f)["traceEvents"]


def profile_compile(step, state, batch, top: int) -> dict:
    import time

    import jax

    wall = time.perf_counter()
    traced = step.trace(state, batch)
    trace_s = time.perf_counter() - wall
    lowered = traced.lower()
    lower_s = time.perf_counter() - wall - trace_s
    from jax.experimental.compilation_cache import compilation_cache

    # a real compile, never a load from a persistent cache: off, and JAX's record of whether
    # the process uses one forgotten (it is kept after the first compile), then back after
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            start = time.perf_counter()
            compiled = lowered.compile()
            compile_s = time.perf_counter() - start
            jax.profiler.stop_trace()
            events = trace_events(trace_dir)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        compilation_cache.reset_cache()
    text = compiled.as_text()
    anatomy = compile_anatomy(events, text, top)
    if not any(anatomy["phase_counts"].values()):
        raise SystemExit(
            "profile_step: the trace shows no XLA compile phase (a JAX whose compiler names "
            "its phases differently?): nothing to report")
    return {"trace_s": round(trace_s, 3), "lower_s": round(lower_s, 3),
            "compile_s": round(compile_s, 3),
            "fusions": len(re.findall(r" fusion\(", text)),
            **anatomy,
            "note": "the compile ran under the profiler (a little slower); phases are "
                    "inclusive wall ms summed over XLA's compile threads"}


def main(argv: list[str] | None = None) -> None:
    prepare_host()  # the process set up as tjax's (on a CPU host: its malloc setting)
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from transformers_jax.bench import bench_configs, training_setup

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-batch", type=int, default=None,
                   help="profile greedy decoding at this batch instead of a training step")
    p.add_argument("--runs", type=int, default=5, help="traced executions (after 3 untimed)")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--compile", action="store_true",
                   help="profile the training step's XLA compile instead of its executions")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    model_cfg, cfg, _, _ = bench_configs(rest)
    if args.compile:
        if args.decode_batch is not None:
            raise SystemExit("profile_step: --compile profiles the training step; drop "
                             "--decode-batch")
        step, state, batch = training_setup(model_cfg, cfg)
        print(json.dumps({"training_step_compile": {"batch_size": cfg.batch_size,
                                                    "seq_len": cfg.seq_len},
                          "model": model_cfg.to_dict(),
                          **profile_compile(step, state, batch, args.top)}, indent=1))
        return
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
        key = jax.random.key(0)
        # the top-level loop, with its compile options (sample.DECODE_COMPILER_OPTIONS)
        compiled = generate_tokens.lower(model, params, prompts, lengths, key,
                                         cfg=greedy).compile()

        def run():
            return compiled(params, prompts, lengths, key)
        what = {"decoding": {"batch": args.decode_batch, "prompt": 16, "new_tokens": 240}}
    for _ in range(3):
        jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.runs):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        events = trace_events(trace_dir)
    summary = summarise(self_times(events), output_shapes(compiled.as_text()), args.runs,
                        args.top)
    print(json.dumps({**what, "model": model_cfg.to_dict(), "runs": args.runs, **summary,
                      "note": "self time per op (nested ops excluded), ms per execution, "
                              "under the profiler"}, indent=1))


if __name__ == "__main__":
    main()
