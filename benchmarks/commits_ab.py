"""``tjax bench`` at two commits, as whole processes in alternating rounds (A B A B ...).

The earlier commit is checked out into a temporary git worktree and run from there (its own
``transformers_jax`` on ``PYTHONPATH``, this environment's packages); the later one runs from
this checkout, or from a worktree too with ``--after REV``. Each round runs both, in turn, so
load drifts hit both; the JSON keeps every run's training figures, the load averages, each
side's spread (``rounds.spread``) and that of the per-round ratios (after / before).

    python benchmarks/commits_ab.py --before HEAD~1 --rounds 8 --out ab.json
    python benchmarks/commits_ab.py --before b779eaf --cores 0 -- --preset bert-cpu
    python benchmarks/commits_ab.py --before HEAD~1 --decode -- --steps 2 --warmup 1
    # arguments after "--" go to `tjax bench` (with --no-decode unless --decode)
    python benchmarks/commits_ab.py --before HEAD --after-args=--train.concurrent_groups=2
    # one commit, two settings: --after-args go to the after side only

``--decode`` times decoding too (``tjax bench``'s greedy loop at each of its decode batches)
and reports its tokens/s and per-round ratios per batch beside the training figures.

Measure on a quiet machine: the script records the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worktree(rev: str, into: str, side: str) -> str:
    """A detached checkout of ``rev`` under ``into`` (a folder per side, so both sides may
    name the same revision); refuses a revision git does not know."""
    path = os.path.join(into, side)
    done = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"commits_ab: cannot check out {rev!r}: {done.stderr.strip()}")
    return path


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def bench(tree: str, bench_args: list[str], cores: str | None, out: str,
          decode: bool = False) -> dict:
    """One ``tjax bench`` process from ``tree`` (``--no-decode`` unless ``decode``); its JSON."""
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, "-m", "transformers_jax.cli", "bench",
           *([] if decode else ["--no-decode"]), *bench_args, "--out", out]
    if cores:
        cmd = ["taskset", "-c", cores, *cmd]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"commits_ab: tjax bench failed in {tree}:\n{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def decode_rates(out: dict) -> dict[str, float]:
    """``{"batch_1": tokens/s, ...}`` from a ``tjax bench`` JSON; a clear error without them."""
    decoding = out.get("decoding")
    if not decoding:
        raise SystemExit("commits_ab: --decode, but tjax bench did not decode "
                         f"({out.get('decoding_note', 'no decoding section')})")
    return {k: v["decode_tokens_per_s"] for k, v in decoding.items() if k.startswith("batch_")}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--after", default=None, help="the later commit (default: this checkout)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cores", default=None, help="run both pinned to these cores (taskset -c)")
    p.add_argument("--out", default=None, help="write the JSON there too")
    p.add_argument("--decode", action="store_true",
                   help="time decoding too and report it per decode batch")
    p.add_argument("--after-args", default="",
                   help="more tjax bench arguments for the after side only (one string, split "
                        "as a shell would; write --after-args=--train.x=1): an A/B of a "
                        "setting, with --before HEAD")
    args = p.parse_args(own)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": worktree(args.before, tmp, "before"),
                 "after": worktree(args.after, tmp, "after") if args.after else ROOT}
        commits = {side: git("-C", tree, "rev-parse", "HEAD") for side, tree in trees.items()}
        # an A/B of uncommitted work: the after side is this checkout, not its HEAD
        dirty = bool(git("-C", ROOT, "status", "--porcelain")) if not args.after else False
        try:
            runs: dict[str, list] = {"before": [], "after": []}
            for r in range(args.rounds):
                for side in ("before", "after"):
                    load = os.getloadavg()[0]
                    extra = shlex.split(args.after_args) if side == "after" else []
                    out = bench(trees[side], [*bench_args, *extra], args.cores,
                                os.path.join(tmp, f"{side}_{r}.json"), args.decode)
                    t = out["training"]
                    runs[side].append({
                        "tokens_per_s": t["tokens_per_s"], "step_ms_median": t["step_ms_median"],
                        "compile_s": t["compile_s"], "mfu": t.get("mfu"),
                        "concurrent_groups": out.get("concurrent_groups"),
                        "load_before": load, "load_after": os.getloadavg()[0],
                        **({"decode_tokens_per_s": decode_rates(out)} if args.decode else {})})
                    print(f"round {r + 1} {side}: {t['tokens_per_s']:,.0f} tokens/s, compile "
                          f"{t['compile_s']:.2f} s, load {load:.2f}", file=sys.stderr, flush=True)
        finally:
            for side in ("before", "after"):
                if trees[side] != ROOT:
                    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force",
                                    trees[side]], capture_output=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"]
              for a, b in zip(runs["after"], runs["before"], strict=True)]
    decoding = {}
    if args.decode:
        for batch in runs["before"][0]["decode_tokens_per_s"]:
            rates = {s: [x["decode_tokens_per_s"][batch] for x in runs[s]] for s in runs}
            decoding[batch] = {
                "tokens_per_s": {s: spread(v) for s, v in rates.items()},
                "ratio_after_over_before": spread(
                    [a / b for a, b in zip(rates["after"], rates["before"], strict=True)])}
    result = {
        "before": args.before, "after": args.after or "checkout", "commits": commits,
        "checkout_has_uncommitted_changes": dirty, "bench_args": bench_args,
        "after_args": shlex.split(args.after_args),
        "cores": args.cores, "rounds": args.rounds, "runs": runs,
        "tokens_per_s": {s: spread([x["tokens_per_s"] for x in runs[s]]) for s in runs},
        "compile_s": {s: spread([x["compile_s"] for x in runs[s]]) for s in runs},
        "ratio_after_over_before": spread(ratios),
        **({"decoding": decoding} if args.decode else {}),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
