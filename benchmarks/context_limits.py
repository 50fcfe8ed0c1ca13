"""The longest sequence each preset trains on a TPU slice, with and without a context axis.

    python benchmarks/context_limits.py --out benchmarks/results/context_limits.jsonl [--skip-done]
    python benchmarks/context_limits.py --only llama-3.2-1b --targets v5e:2x4
    python benchmarks/context_limits.py --table benchmarks/results/context_limits.jsonl

For each preset and target, two layouts, each at one sequence per data-parallel group:
``without``, FSDP over every chip (sequences whole on each); ``with``, FSDP times a
``context`` axis of ``--contexts`` ways (each sequence split over that many chips, attention by
``ring_zigzag``). The length doubles from ``--start`` until the TPU compiler says the step no
longer fits (remat ``full``, the chunked kernel, bfloat16, layers scanned), up to the
preset's position table (``max_len``) where it has one; the memory's growth between the first
two lengths says where to look next, so most doublings are not compiled. A row gives the
longest length that fits, the first that does not, and every compile tried. Compiles take
minutes on a 2-core host and one row is several of them: run it alone, in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from transformers_jax.cli import build_configs
from transformers_jax.plan import compile_train, tpu_target
from transformers_jax.study.provenance import code_state, describe

COMMON = ["--model.dtype=bfloat16", "--model.dropout=0.0", "--model.scan_layers=true",
          "--model.remat=full", "--model.attention=chunked", "--train.strategy=jit",
          "--train.context_attention=ring_zigzag"]
PRESETS = ("gpt2-xl", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b")
TARGETS = {"v5e:2x4": "v5e-8", "v5p:2x4x4": "v5p-64"}
LONGEST = 2**20  # stop doubling here whatever the preset allows


def mesh_for(chips: int, context: int) -> str:
    return f"data=1,fsdp={chips // context},context={context},tensor=1"


def fits_at(name: str, target_name: str, context: int, seq_len: int) -> dict:
    """One compile: does ``name`` train one sequence of ``seq_len`` per FSDP group?"""
    target = tpu_target(target_name)
    devices = len(target.devices)
    argv = ["--preset", name, *COMMON, f"--train.seq_len={seq_len}",
            f"--train.batch_size={devices // context}",
            f"--train.mesh={mesh_for(devices, context)}"]
    model_cfg, cfg = build_configs(argv)
    wall = time.perf_counter()
    got = compile_train(model_cfg, cfg, target)
    memory = got["memory"]
    return {"seq_len": seq_len, "fits": memory["fits"],
            "bytes_per_chip": memory.get("total_bytes", 0) * target.devices_per_chip or None,
            "compiler": memory.get("compiler"), "compile_s": time.perf_counter() - wall,
            "command": " ".join(["tjax plan --target", target_name, "--no-decode", *argv])}


def longest(name: str, target_name: str, context: int, start: int,
            log=lambda text: None) -> dict:
    """The longest power-of-two multiple of ``start`` whose step fits (up to the preset's
    position table): the last that fits and the first that does not, each a compile. Two
    compiles (``start`` and twice it) give the memory's growth per token; the walk starts at
    the length that line puts at the chip's HBM and doubles or halves from there, so a row
    costs about four compiles instead of one per doubling."""
    model_cfg, _ = build_configs(["--preset", name])
    table = model_cfg.position.max_length(model_cfg)  # a learned table's end, else None
    ceiling = min(table or LONGEST, LONGEST)
    hbm = tpu_target(target_name).chip.hbm_bytes
    tried: dict[int, dict] = {}

    def fits(seq_len: int) -> bool:
        if seq_len not in tried:
            tried[seq_len] = fits_at(name, target_name, context, seq_len)
            log(json.dumps({k: tried[seq_len][k] for k in ("seq_len", "fits", "bytes_per_chip")}))
        return tried[seq_len]["fits"]

    low = seq_len = min(start, ceiling)
    if fits(seq_len) and 2 * seq_len <= ceiling and fits(2 * seq_len):
        b1, b2 = tried[seq_len]["bytes_per_chip"], tried[2 * seq_len]["bytes_per_chip"]
        seq_len *= 2
        if b1 and b2 and b2 > b1:  # bytes = a + slope * tokens, roughly (remat full, chunks)
            predicted = seq_len + (hbm - b2) * seq_len / (b2 - b1)
            while 2 * seq_len <= min(predicted, ceiling):
                seq_len *= 2
    if fits(seq_len):
        while 2 * seq_len <= ceiling and fits(2 * seq_len):
            seq_len *= 2
    else:
        while seq_len > low and not fits(seq_len // 2):
            seq_len //= 2
        seq_len //= 2
    best = tried.get(seq_len) if seq_len in tried and tried[seq_len]["fits"] else None
    first_failure = tried.get(seq_len * 2 if best else low)
    if first_failure is not None and first_failure["fits"]:
        first_failure = None
    return {"config": name, "target": target_name, "slice": TARGETS.get(target_name),
            "context": context, "mesh": mesh_for(len(tpu_target(target_name).devices), context),
            "longest": best and best["seq_len"],
            "bytes_per_chip": best and best["bytes_per_chip"],
            "limit": ("position table" if first_failure is None and ceiling == table else
                      "not reached" if first_failure is None else "memory"),
            "first_failure": first_failure and first_failure["seq_len"],
            "tried": [{k: t[k] for k in ("seq_len", "fits", "bytes_per_chip", "compile_s")}
                      for t in sorted(tried.values(), key=lambda t: t["seq_len"])],
            "command": (best or first_failure or {}).get("command")}


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ways = sorted({r["context"] for r in rows if r["context"] > 1})
    out = ["| preset | slice | without context: longest (GiB per chip) | with context="
           f"{'/'.join(map(str, ways)) or '?'}: longest (GiB per chip) |", "|---|---|---|---|"]
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r["config"], r["target"]), {})[r["context"] > 1] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return "not planned"
        if r["longest"] is None:
            return f"none from {r['first_failure']:,}"
        gib = f"{r['bytes_per_chip'] / 2**30:.1f}" if r["bytes_per_chip"] else "?"
        more = {"position table": ", its position table's end", "not reached":
                f", stopped at {LONGEST:,}", "memory": ""}[r["limit"]]
        return f"{r['longest']:,} ({gib}){more}"

    for (config, target), pair in pairs.items():
        out.append(f"| {config} | {TARGETS.get(target, target)} (`{target}`) | "
                   f"{cell(pair.get(False))} | {cell(pair.get(True))} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PRESETS), help="comma-separated presets")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--contexts", type=int, default=4, help="context ways of the second "
                        "layout (default 4)")
    parser.add_argument("--start", type=int, default=4096, help="first length tried")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    parser.add_argument("--table", metavar="JSONL", help="print the markdown table of a run")
    parser.add_argument("--skip-done", action="store_true",
                        help="skip rows already in --out (to continue an interrupted run)")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    commit = describe(code_state())  # recorded in each row: which code planned it
    done = set()
    if args.skip_done and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            done = {(r["config"], r["target"], r["context"]) for r in map(json.loads, f) if r}
    for target_name in args.targets.split(","):
        for name in args.only.split(","):
            for context in (1, args.contexts):
                if (name, target_name, context) in done:
                    continue
                row = {**longest(name, target_name, context, args.start,
                                 log=lambda text, n=name: print(f"  {n}: {text}",
                                                                file=sys.stderr)),
                       "commit": commit}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
