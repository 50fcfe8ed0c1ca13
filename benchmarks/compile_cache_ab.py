"""``tjax train`` with an empty compilation cache, then again with the one it filled.

Each round makes a fresh cache folder and runs the same ``tjax train`` command twice, each a
whole process (``TJAX_COMPILE_CACHE`` pointing at the folder): the first compiles and writes
its programs, the second should load them. It records each process's wall time, the
``compile_s`` of its final JSON line and its final loss (which must agree: a loaded program
is the same program), the load average around it, and per round the ratio warm / cold.

    python benchmarks/compile_cache_ab.py --rounds 3 --out cache_ab.json -- --steps 20
    # arguments after "--" go to `tjax train` (always with --json --no-progress)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(cache: str, run_dir: str, train_args: list[str]) -> dict:
    """One ``tjax train`` process with ``cache`` as its compilation cache."""
    env = {**os.environ, "TJAX_COMPILE_CACHE": cache}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # else JAX's own folder would be used
    cmd = [sys.executable, "-m", "transformers_jax.cli", "train", *train_args, "--json",
           "--no-progress", "--run-dir", run_dir]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"compile_cache_ab: tjax train failed:\n{done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit("compile_cache_ab: tjax train printed no JSON line (--json)")
    final = json.loads(lines[-1])
    return {"wall_s": wall, "compile_s": final["compile_s"], "train_loss": final["train_loss"],
            "load_before": load, "load_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON there too")
    args = p.parse_args(own)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    runs: dict[str, list] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            cache = os.path.join(tmp, f"cache_{r}")  # empty for the first process of a round
            for side in ("cold", "warm"):
                got = train(cache, os.path.join(tmp, f"run_{side}_{r}"), train_args)
                runs[side].append(got)
                print(f"round {r + 1} {side}: {got['wall_s']:.2f} s, compile "
                      f"{got['compile_s']:.2f} s, load {got['load_before']:.2f}",
                      file=sys.stderr, flush=True)
    same_losses = all(c["train_loss"] == w["train_loss"]
                      for c, w in zip(runs["cold"], runs["warm"], strict=True))
    result = {
        "train_args": train_args, "rounds": args.rounds, "runs": runs,
        "wall_s": {s: spread([x["wall_s"] for x in runs[s]]) for s in runs},
        "compile_s": {s: spread([x["compile_s"] for x in runs[s]]) for s in runs},
        "wall_ratio_warm_over_cold": spread(
            [w["wall_s"] / c["wall_s"] for c, w in zip(runs["cold"], runs["warm"], strict=True)]),
        "same_final_losses": same_losses,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not same_losses:
        raise SystemExit("compile_cache_ab: a warm run's final loss differs from its cold run's")
    return result


if __name__ == "__main__":
    main()
