"""``tjax bench`` under different malloc settings (``transformers_jax/host_memory.py``), each
a whole process, alternating A B A B; prints one JSON object.

    python benchmarks/host_memory_ab.py --rounds 4                 # config a, float32
    python benchmarks/host_memory_ab.py --rounds 4 -- --model.dtype=bfloat16

    python benchmarks/host_memory_ab.py --rounds 4 --sides tjax_default,reuse

The sides (``--sides``, the first is the baseline; default ``system_malloc,tjax_default``):
``system_malloc`` is ``TJAX_HOST_MALLOC=system`` (glibc's defaults: XLA's temporary buffer is
faulted in 4 KiB pages every step), ``tjax_default`` what ``tjax`` does by default (the buffer
on transparent huge pages, still faulted in every step), ``reuse`` is
``TJAX_HOST_MALLOC=reuse`` (the freed buffer kept for the next step). Per side: the median, min
and max of training tokens/s, minor page faults per step, compile seconds and peak RSS over
the rounds; per later side, the median of the per-round ratios side / baseline. Arguments after
``--`` go to ``tjax bench`` (default: ``--no-decode``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from transformers_jax import host_memory
from transformers_jax.overrides import print_json

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import spread  # noqa: E402

SIDES = {"system_malloc": {host_memory.OPT_OUT: "system"}, "tjax_default": {},
         "reuse": {host_memory.OPT_OUT: "reuse"}}


def one_process(extra_env: dict, bench_args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in host_memory.VARIABLES}
    env.update(extra_env)
    command = [sys.executable, "-m", "transformers_jax.cli", "bench", *bench_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    training = out["training"]
    return {"tokens_per_s": training["tokens_per_s"],
            "minor_page_faults_per_step": training["minor_page_faults_per_step"],
            "compile_s": training["compile_s"], "peak_rss_mib": out["peak_rss_bytes"] / 2**20,
            "host_malloc": out["host_malloc"], "load_average": out["load_average"][0]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) \
        if "--" in argv else (argv, ["--no-decode"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sides", default="system_malloc,tjax_default",
                        help=f"comma-separated, from {', '.join(SIDES)}; the first is the "
                             "baseline of the ratios")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(ours)
    sides = args.sides.split(",")
    if len(sides) < 2 or len(set(sides)) < len(sides) or not set(sides) <= set(SIDES):
        parser.error(f"--sides {args.sides!r}: give two or more different sides from "
                     f"{', '.join(SIDES)}")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    start_load = os.getloadavg()
    for _ in range(args.rounds):
        for side in sides:
            runs[side].append(one_process(SIDES[side], bench_args))
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *argv]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds,
              "tjax_bench_args": bench_args, "load_average_start": list(start_load),
              "load_average_end": list(os.getloadavg()),
              "host_malloc": {side: rs[0]["host_malloc"] for side, rs in runs.items()}}
    for side, rs in runs.items():
        result[side] = {key: spread([r[key] for r in rs]) for key in
                        ("tokens_per_s", "minor_page_faults_per_step", "compile_s",
                         "peak_rss_mib", "load_average")}
    base = sides[0]
    for side in sides[1:]:  # e.g. speedup_tjax_default_over_system_malloc
        ratios = [b["tokens_per_s"] / a["tokens_per_s"]
                  for a, b in zip(runs[base], runs[side], strict=True)]
        result[f"speedup_{side}_over_{base}"] = spread(ratios)
    print_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
