"""Plans of named model shapes on TPU targets: the rows of the README's "what fits where" table.

    python benchmarks/plan_presets.py --out benchmarks/results/plan_presets.jsonl
    python benchmarks/plan_presets.py --only gpt2 --targets v5e:2x4      # one row

For each preset and target it runs ``tjax plan --search --search-meshes fsdp`` (pure data
parallelism, and FSDP over every chip times tensor parallelism within a host; remat policies
none, dots_with_no_batch_dims_saveable, full until one fits) and prints one JSON line per row:
fits?, the fastest mesh and remat that fit, per-chip memory, predicted step time and MFU, and
the command that reproduces it. The batch is a fixed number of sequences per chip (as
MaxText's per_device_batch_size), so every target trains the same tokens per chip. These are
compiler figures (XLA memory and cost analysis of the TPU program, loops counted as often as
they run) and a datasheet roofline, not measured runs. Each compile takes seconds to a
minute on a CPU host; run it alone (or at low priority: ``nice -n 19``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from transformers_jax.cli import build_configs
from transformers_jax.plan import DEFAULT_REMATS, plan, tpu_target

COMMON = ["--model.dtype=bfloat16", "--model.dropout=0.0", "--model.scan_layers=true"]

# preset -> (sequences per chip, sequence length)
CONFIGS: dict[str, tuple[int, int]] = {
    "gpt2": (8, 1024), "gpt2-medium": (8, 1024), "gpt2-large": (8, 1024), "gpt2-xl": (8, 1024),
    "bert-base": (16, 512), "bert-large": (16, 512), "t5-base": (16, 512),
    "llama-3.2-1b": (4, 2048), "llama-3.1-8b": (4, 2048),
}
# Google names v5e slices by chips and v5p slices by TensorCores (two per chip)
TARGETS = {"v5e:2x4": "v5e-8", "v5p:2x2x1": "v5p-8", "v5p:2x4x4": "v5p-64"}


def row(name: str, target_name: str, attention: str) -> dict:
    per_chip, seq_len = CONFIGS[name]
    target = tpu_target(target_name)
    batch = per_chip * target.chips
    argv = ["--preset", name, *COMMON, f"--model.attention={attention}",
            "--train.strategy=jit", f"--train.batch_size={batch}", f"--train.seq_len={seq_len}"]
    model_cfg, cfg = build_configs(argv)
    wall = time.perf_counter()
    result = plan(model_cfg, cfg, target, do_search=True, remats=DEFAULT_REMATS, decode=False,
                  meshes="fsdp",
                  log=lambda text: print(f"  {name} {target_name}: {text}", file=sys.stderr))
    best = result["train"]
    command = " ".join(["tjax plan --target", target_name, "--search --search-meshes fsdp",
                        "--no-decode", *argv])
    out = {"config": name, "target": target_name, "slice": TARGETS.get(target_name),
           "batch": batch, "seq_len": seq_len, "attention": attention, "fits": best is not None,
           "tried": result["search"], "command": command,
           "plan_s": time.perf_counter() - wall}
    if best is not None:
        out.update(mesh=best["mesh"], remat=best["remat"], params=best["params"],
                   bytes_per_chip=best["memory"]["total_bytes"] * target.devices_per_chip,
                   hbm_per_chip=target.chip.hbm_bytes,
                   step_s=best["roofline"]["step_s"], mfu=best["roofline"]["mfu"],
                   step_s_overlapped=best["roofline"]["step_s_overlapped"],
                   mfu_overlapped=best["roofline"]["mfu_overlapped"],
                   bound=best["roofline"]["bound"], tokens_per_s=best["tokens_per_s"],
                   ici_bytes_per_device=best["ici_bytes_per_device"])
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table(path: str) -> str:
    """The README table (markdown) from the JSON lines of a run."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    order = {name: i for i, name in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (list(TARGETS).index(r["target"]) if r["target"] in TARGETS else 9,
                             order.get(r["config"], 99)))
    out = ["| preset | slice (topology) | batch x length | fits | best mesh | remat | "
           "GiB per chip (of HBM) | step s | MFU | bound | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = f"{r.get('slice')} (`{r['target']}`)"
        if "error" in r:
            out.append(f"| {r['config']} | {where} | | error: {r['error'][:80]} |||||||")
            continue
        shape = f"{r['batch']} x {r['seq_len']}"
        if not r["fits"]:
            out.append(f"| {r['config']} | {where} | {shape} | **no** (any mesh tried, any "
                       "remat) |||||||")
            continue
        out.append(
            f"| {r['config']} | {where} | {shape} | yes | `{r['mesh']}` | {r['remat']} | "
            f"{_gib(r['bytes_per_chip'])} ({_gib(r['hbm_per_chip'])}) | {r['step_s']:.3f} | "
            f"{100 * r['mfu']:.0f}% | {r['bound']} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated config names")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--skip-done", action="store_true",
                        help="skip rows already in --out (to continue an interrupted run)")
    parser.add_argument("--attention", default="pallas",
                        help="pallas (the TPU flash kernel), chunked or xla")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    parser.add_argument("--table", metavar="JSONL", help="print the README table of a run's "
                        "JSON lines, and nothing else")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    names = args.only.split(",") if args.only else list(CONFIGS)
    done = set()
    if args.skip_done and args.out:
        try:
            with open(args.out) as f:
                done = {(r["config"], r["target"]) for r in map(json.loads, f) if r}
        except FileNotFoundError:
            pass
    for target in args.targets.split(","):  # every preset on the small slices first
        for name in names:
            if (name, target) in done:
                continue
            try:
                text = json.dumps(row(name, target, args.attention))
            except Exception as err:  # noqa: BLE001 - one failed row must not lose the others
                text = json.dumps({"config": name, "target": target, "slice": TARGETS.get(target),
                                   "error": f"{type(err).__name__}: {err}"[:500]})
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
