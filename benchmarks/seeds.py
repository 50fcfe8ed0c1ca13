"""Seeds trained together (``train.seeds.train_seeds``) against the same seeds trained one
after another (``train.loop.train`` per seed), on this host; and the S-seed step compiled for a
TPU target (``tjax plan --seeds S``).

Prints one JSON object. Each measurement runs in a fresh process (``--child``), the two ways
alternating (together, one after another, together, ...) so that drifting machine load falls on
both; the JSON gives each way's runs, their median and range, the load average before and
after, and the ratios of the medians:

- ``tokens_per_s``: steady training throughput of all the seeds together, compiles and the
  final evaluation excluded (``train``'s own figure; one after another: all tokens over the
  runs' summed steady time);
- ``wall_s``: the whole job from configs to final metrics, compiles, data set-up and
  initialisation included (no persistent compile cache: every process compiles).

    python benchmarks/seeds.py --cells tiny:3,tiny:8,default:3,default:8 --repeats 3
    python benchmarks/seeds.py --tpu v5e:2x4 --cells tiny:8,default:8   # compile only

``tiny``: width 32, 1 layer, 2 heads, batch 8 x 32 tokens; ``default``: ``ModelConfig()`` and
``TrainConfig()``'s batch (16 x 128), the README's first run. Both on the default corpus with
the byte tokenizer, dropout 0, nothing saved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODELS = {
    "tiny": ({"d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 32},
             {"batch_size": 8, "seq_len": 32}, 100),
    "default": ({}, {}, 30),
}


def configs(model: str, steps: int | None):
    from transformers_jax import ModelConfig, TrainConfig

    model_fields, train_fields, default_steps = MODELS[model]
    steps = steps or default_steps
    return ModelConfig(**model_fields), TrainConfig(
        steps=steps, log_every=steps, eval_every=steps, eval_batches=1, progress=False,
        tensorboard=False, **train_fields)


def child(way: str, model: str, seeds: int, steps: int | None) -> dict:
    """One measurement, in this process."""
    from transformers_jax.backends import prepare_host

    malloc = prepare_host()  # as `tjax train` sets the process up (may re-execute it)
    import jax

    from transformers_jax import backends
    from transformers_jax.train.loop import train
    from transformers_jax.train.seeds import train_seeds

    model_cfg, cfg = configs(model, steps)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    load = os.getloadavg()
    start = time.perf_counter()
    if way == "together":
        results = train_seeds(model_cfg, cfg, list(range(seeds)))
        wall = time.perf_counter() - start
        tokens_per_s = results[0]["tokens_per_s"] * seeds
        compile_s = results[0]["compile_s"]
    else:
        results = [train(model_cfg, cfg.replace(seed=s)) for s in range(seeds)]
        wall = time.perf_counter() - start
        # all the runs' tokens over their summed steady time
        tokens_per_s = seeds / sum(1 / r["tokens_per_s"] for r in results)
        compile_s = sum(r["compile_s"] for r in results)
    return {"way": way, "model": model, "seeds": seeds, "steps": cfg.steps,
            "tokens_per_step_per_seed": tokens_per_step, "params": results[0]["params"],
            "tokens_per_s": tokens_per_s, "steps_per_s": tokens_per_s / tokens_per_step / seeds,
            "wall_s": wall, "compile_s": compile_s, "load_before": load,
            "final_train_loss": [r["train_loss"] for r in results],
            "device": jax.devices()[0].device_kind, "malloc": malloc,
            "backend": repr(backends.for_devices(jax.devices()[:1]))}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def measure(model: str, seeds: int, repeats: int, steps: int | None) -> dict:
    """Alternating fresh processes, together first; medians, ranges and ratios."""
    runs: dict[str, list[dict]] = {"together": [], "one_after_another": []}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for way in runs:
            out = subprocess.run(
                [sys.executable, __file__, "--child", way, "--cells", f"{model}:{seeds}",
                 *(["--steps", str(steps)] if steps else [])],
                capture_output=True, text=True, check=False)
            if out.returncode:
                raise RuntimeError(f"{way} {model}:{seeds} failed:\n{out.stderr[-3000:]}")
            runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{model}:{seeds} {way}: {runs[way][-1]['tokens_per_s']:,.0f} tokens/s, "
                  f"{runs[way][-1]['wall_s']:.1f} s", file=sys.stderr)
    summary: dict = {"model": model, "seeds": seeds, "steps": runs["together"][0]["steps"],
                     "backend": runs["together"][0]["backend"],
                     "params": runs["together"][0]["params"],
                     "tokens_per_step_per_seed": runs["together"][0]["tokens_per_step_per_seed"],
                     "load_average": {"before": load_before, "after": os.getloadavg()}}
    for way, rows in runs.items():
        summary[way] = {key: _spread([r[key] for r in rows])
                        for key in ("tokens_per_s", "steps_per_s", "wall_s", "compile_s")}
    med = {way: {k: summary[way][k]["median"] for k in ("tokens_per_s", "wall_s")}
           for way in runs}
    summary["speedup"] = {
        "tokens_per_s": med["together"]["tokens_per_s"] / med["one_after_another"]["tokens_per_s"],
        "wall": med["one_after_another"]["wall_s"] / med["together"]["wall_s"]}
    return summary


def tpu_plan(target_name: str, model: str, seeds: int) -> dict:
    """The S-seed step (and the one-seed step) compiled for ``target_name``, the seeds over as
    many chips as divide them (a ``seed`` mesh axis), its memory per chip against the chip's
    HBM, as ``tjax plan --strategy single --seeds S`` prints it."""
    from transformers_jax.plan import compile_train, tpu_target

    target = tpu_target(target_name)
    model_cfg, cfg = configs(model, None)
    cfg = cfg.replace(strategy="single")
    out = {"target": target_name, "chip": target.chip.name, "model": model,
           "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}
    for s in (1, seeds):
        plan = compile_train(model_cfg, cfg, target, seeds=s)
        out[f"seeds_{s}"] = {k: plan.get(k) for k in ("params", "devices", "mesh", "compile_s",
                                                       "memory", "collectives",
                                                       "flops_per_device",
                                                       "bytes_accessed_per_device",
                                                       "roofline", "tokens_per_s")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="tiny:3,tiny:8,default:3,default:8",
                        help="MODEL:SEEDS,... (models: tiny, default)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per way and cell")
    parser.add_argument("--steps", type=int, help="steps per run (default: tiny 100, "
                        "default 30)")
    parser.add_argument("--tpu", metavar="TARGET", help="compile instead, for this TPU "
                        "topology (e.g. v5e:2x4; needs libtpu)")
    parser.add_argument("--out", help="also write the JSON there")
    parser.add_argument("--child", choices=("together", "one_after_another"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    cells = [(m, int(s)) for m, s in (c.split(":") for c in args.cells.split(","))]
    if args.child:
        (model, seeds), = cells
        print(json.dumps(child(args.child, model, seeds, args.steps)))
        return
    if args.tpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the TPU from this host
        result = {"tpu": [tpu_plan(args.tpu, m, s) for m, s in cells]}
    else:
        result = {"cells": [measure(m, s, args.repeats, args.steps) for m, s in cells]}
    result["host"] = {"cpu": _cpu_name(), "cores": os.cpu_count(),
                      "python": platform.python_version(), "command": " ".join(sys.argv),
                      "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
