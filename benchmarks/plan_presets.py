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
import statistics
import sys
import time

from transformers_jax.cli import build_configs
from transformers_jax.plan import DEFAULT_REMATS, GPU_SPECS, plan, tpu_target
from transformers_jax.study.provenance import code_state, describe

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
                   hbm_per_chip=target.chip.hbm_bytes, **_figures(best, target))
    return out


def _figures(planned: dict, target) -> dict:
    """The figures a row keeps of one planned train step: memory, roofline and traffic."""
    line = planned["roofline"]
    return dict(bytes_per_chip=planned["memory"]["total_bytes"] * target.devices_per_chip,
                step_s=line["step_s"], mfu=line["mfu"], mfu_causal_half=line["mfu_causal_half"],
                bound=line["bound"], split=line["split"], top_ops=line["top_ops"][:3],
                whole_program={k: line["whole_program"][k] for k in (
                    "step_s", "mfu", "step_s_overlapped", "mfu_overlapped", "bound")},
                tokens_per_s=planned["tokens_per_s"],
                ici_bytes_per_device=planned["ici_bytes_per_device"])


def replan(old: dict) -> dict:
    """A row of an earlier run planned again on its chosen mesh (no mesh search): the
    per-operation roofline's step time, MFU, bound and split, and the memory, from a fresh
    compile. The remat policies are tried in the search's order from the cheapest, as
    ``--search`` does on one mesh, so a row whose policy a model change made costlier or
    cheaper follows it; the search's own choice stays under ``searched_remat`` when it
    differs. Only rows that fit are planned again (``main`` skips the others)."""
    target = tpu_target(old["target"])
    argv = [a for a in old["command"].split()[5:] if a.startswith("--") and a not in (
        "--search", "--no-decode", "--preset", "--search-meshes")]
    searched = old.get("searched_remat", old["remat"])
    wall = time.perf_counter()
    refused = []
    for remat in DEFAULT_REMATS:
        model_cfg, cfg = build_configs(["--preset", old["config"], *[a for a in argv if "=" in a],
                                        f"--train.mesh={old['mesh']}", f"--model.remat={remat}"])
        got = plan(model_cfg, cfg, target, decode=False)["train"]
        if got["memory"]["fits"]:  # the compiler can accept a program larger than the HBM
            break
        refused.append(f"{remat}: " + (got["memory"].get("compiler") or "{:.1f} GiB".format(
            got["memory"]["total_bytes"] * target.devices_per_chip / 2**30))[:120])
    else:
        return {**old, "replan_refused": "; ".join(refused),
                "replan_s": time.perf_counter() - wall}
    out = {k: v for k, v in old.items() if k not in (
        "replan_refused", "replan_refused_remats", "searched_remat", "step_s_overlapped",
        "mfu_overlapped")}
    out.update(remat=remat, replan_s=time.perf_counter() - wall, **_figures(got, target))
    if remat != searched:
        out["searched_remat"] = searched
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


CALIBRATION = "benchmarks/results/plan_calibration.json"


def expected_error(path: str = CALIBRATION, gpu: bool = False) -> float | None:
    """The median |error| (MFU points) of the calibration's plans of published runs
    (``benchmarks/plan_calibration.py``) on TPUs (or, ``gpu``, on GPUs); None without its
    file."""
    try:
        with open(path) as f:
            runs = [r for r in json.load(f)["runs"] if "error_points" in r
                    and r["target"].startswith(tuple(GPU_SPECS)) == gpu]
    except FileNotFoundError:
        return None
    return statistics.median(abs(r["error_points"]) for r in runs) if runs else None


def table(path: str) -> str:
    """The README table (markdown) from the JSON lines of a run."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    order = {name: i for i, name in enumerate(CONFIGS)}
    error = expected_error()
    rows.sort(key=lambda r: (list(TARGETS).index(r["target"]) if r["target"] in TARGETS else 9,
                             order.get(r["config"], 99)))
    out = ["| preset | slice (topology) | batch x length | fits | best mesh | remat | "
           "GiB per chip (of HBM) | step s | MFU (expected error) | bound | tokens/s | "
           "whole-program MFU (every FLOP at peak) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = f"{r.get('slice')} (`{r['target']}`)"
        if "error" in r:
            out.append(f"| {r['config']} | {where} | | error: {r['error'][:80]} ||||||||")
            continue
        shape = f"{r['batch']} x {r['seq_len']}"
        if not r["fits"]:
            out.append(f"| {r['config']} | {where} | {shape} | **no** (any mesh tried, any "
                       "remat) ||||||||")
            continue
        memory = f"{_gib(r['bytes_per_chip'])} ({_gib(r['hbm_per_chip'])})"
        if "replan_refused" in r:  # fitted when searched, refused when compiled again
            out.append(f"| {r['config']} | {where} | {shape} | **no** when re-planned on "
                       f"`{r['mesh']}`, any remat: {r['replan_refused'][:70]} | | | | | "
                       f"| | | {100 * r['mfu']:.0f}% |")
            continue
        if "split" not in r:  # planned before the per-operation roofline, not re-planned
            out.append(f"| {r['config']} | {where} | {shape} | yes | `{r['mesh']}` | "
                       f"{r['remat']} | {memory} | | not re-planned | | | "
                       f"{100 * r['mfu']:.0f}% |")
            continue
        mfu = f"{100 * r['mfu']:.0f}%" + (f" (±{error:.0f})" if error is not None else "")
        before = r.get("whole_program", {}).get("mfu")
        remat = r["remat"] + (f" (search: {r['searched_remat']})" if "searched_remat" in r
                              else "")
        out.append(
            f"| {r['config']} | {where} | {shape} | yes | `{r['mesh']}` | {remat} | "
            f"{memory} | {r['step_s']:.3f} | {mfu} | {r['bound']} | "
            f"{r['tokens_per_s']:,.0f} | {'' if before is None else f'{100 * before:.0f}%'} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated config names")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--skip-done", action="store_true",
                        help="skip rows already in --out, or with --replan those re-planned "
                        "at this commit (to continue an interrupted run)")
    parser.add_argument("--attention", default="pallas",
                        help="pallas (the TPU flash kernel), chunked or xla")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    parser.add_argument("--table", metavar="JSONL", help="print the README table of a run's "
                        "JSON lines, and nothing else")
    parser.add_argument("--replan", metavar="JSONL", help="plan again the rows of a run's "
                        "JSON lines (--only: those presets) on their chosen mesh, remat policies "
                        "from the cheapest that fits, "
                        "with the per-operation roofline; rewrite the file")
    args = parser.parse_args()
    if args.replan:
        with open(args.replan) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        commit = describe(code_state())
        for i, old in enumerate(rows):
            if (args.only and old["config"] not in args.only.split(",")) or (
                    old.get("target") not in args.targets.split(",")) or (
                    args.skip_done and old.get("replan_commit") == commit):
                continue
            if not old.get("fits"):  # nothing to plan again on (the search found no fit)
                continue
            rows[i] = {**replan(old), "replan_commit": commit}
            print(json.dumps({k: rows[i].get(k) for k in ("config", "target", "mfu", "bound")}),
                  flush=True)
            with open(args.replan, "w") as f:  # each row as it is done
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return 0
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
