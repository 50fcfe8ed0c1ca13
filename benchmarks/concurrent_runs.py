"""Is it faster to train small models side by side? One ``tjax train`` process against N at
once (what ``experiments.length_extrapolation --workers N`` does), alternating rounds; prints
one JSON object.

    python benchmarks/concurrent_runs.py --workers 2 --rounds 3
    python benchmarks/concurrent_runs.py --workers 2 -- --train.seq_len=128 --train.batch_size=8

Every process is a plain ``tjax train`` with the library's default threading (XLA's pool over
every core), the experiments' model and batch (width 128, 4 layers, batch 16 x 64) unless
arguments after ``--`` change them. Per round: one process alone, then N started together.
Reported per side: training tokens/s as each process logs it (its steady state) and the
whole side's tokens over its wall time (start-up and compile included: what an experiment
sees), with the median, min and max over rounds, the per-round ratio N-together / alone, and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from transformers_jax.overrides import print_json

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import spread  # noqa: E402

from experiments.common import pinned, worker_cores  # noqa: E402

DEFAULT_ARGS = ["--steps", "400", "--train.batch_size=16", "--train.seq_len=64",
                "--train.eval_every=400", "--train.log_every=400"]


clock = time.perf_counter


def start(train_args: list[str], cores: list[int]) -> tuple[subprocess.Popen, object, object]:
    """One ``tjax train``, its output to files (a full pipe would stall it while another
    process is waited for); ``cores``: pinned to those (XLA then sizes its thread pool to them,
    as under ``taskset -c``), the way ``experiments --workers`` starts its workers; empty: not
    pinned."""
    command = [sys.executable, "-m", "transformers_jax.cli", "train", "--no-progress", "--json",
               *train_args]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    return subprocess.Popen(pinned(command, cores), stdout=out, stderr=err, text=True), out, err


def finish(started: tuple[subprocess.Popen, object, object]) -> dict:
    """The final metrics ``tjax train --json`` printed (its last line)."""
    proc, out, err = started
    proc.wait()
    out.seek(0)
    err.seek(0)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(proc.args)} failed:\n{err.read()[-2000:]}")
    return json.loads(out.read().strip().splitlines()[-1])


def side(n: int, train_args: list[str], pin: bool = False) -> dict:
    """``n`` processes started together (``pin``: each on its own cores, as
    ``experiments.common.worker_cores`` splits them): their logged tokens/s and the side's wall
    rate."""
    groups = worker_cores(n) if pin else [[]] * n
    began = clock()
    finals = [finish(p) for p in [start(train_args, cores) for cores in groups]]
    wall = clock() - began
    tokens = sum(f["steps"] * f["tokens_per_step"] for f in finals)
    return {"logged_tokens_per_s": sum(f["tokens_per_s"] for f in finals),
            "wall_s": wall, "wall_tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true",
                        help="add a side: the N processes each on its own cores")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(ours)
    if args.workers < 2:
        parser.error("--workers: at least 2 (one is the 'alone' side)")
    train_args = DEFAULT_ARGS + train_args  # later options win
    start_load = os.getloadavg()
    rounds = {"alone": [], "together": []} | ({"pinned": []} if args.pin else {})
    for _ in range(args.rounds):
        rounds["alone"].append(side(1, train_args))
        rounds["together"].append(side(args.workers, train_args))
        if args.pin:
            rounds["pinned"].append(side(args.workers, train_args, pin=True))
    result = {"command": " ".join([os.path.basename(sys.argv[0]), *argv]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": os.cpu_count(),
              "workers": args.workers, "rounds": args.rounds, "tjax_train_args": train_args,
              "load_average_start": list(start_load), "load_average_end": list(os.getloadavg())}
    keys = ("logged_tokens_per_s", "wall_tokens_per_s", "wall_s")
    for name, rs in rounds.items():
        result[name] = {k: spread([r[k] for r in rs]) for k in keys}
    for k in ("logged_tokens_per_s", "wall_tokens_per_s"):
        result[f"ratio_{k}"] = spread([t[k] / a[k] for a, t in zip(
            rounds["alone"], rounds["together"], strict=True)])
        if args.pin:
            result[f"ratio_pinned_{k}"] = spread([t[k] / a[k] for a, t in zip(
                rounds["alone"], rounds["pinned"], strict=True)])
    print_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
