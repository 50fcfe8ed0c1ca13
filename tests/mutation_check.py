"""Does the suite catch bugs? Plant one-line bugs (mutants) in the library, one at a time, and
see which test tier kills each: the quick tier (``-m "not slow"``) and, for a mutant the quick
tier misses, the whole suite. Each mutant runs in a scratch copy of the working tree, imported
before the installed package (``PYTHONPATH``), so `tjax` subprocesses see it too.

    python tests/mutation_check.py                 # every mutant, quick tier then full suite
    python tests/mutation_check.py --tier quick --only causal_sees_no_self
    python tests/mutation_check.py --list

Prints one JSON line per mutant (``killed_by``: the first failing test's id, or null) and a
table at the end. A tier stops at its first failure (``-x``), so a killed mutant is cheap; one
that survives costs the whole tier.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    area: str


MUTANTS = [
    Mutant("causal_sees_no_self", "transformers_jax/nn/masks.py",
           "return k_pos[:, None, None, :] <= q_pos[:, None, :, None]",
           "return k_pos[:, None, None, :] < q_pos[:, None, :, None]", "masks"),
    Mutant("window_one_wider", "transformers_jax/nn/masks.py",
           "k_pos[:, None, None, :]) < window", "k_pos[:, None, None, :]) <= window", "masks"),
    Mutant("prefix_one_longer", "transformers_jax/nn/masks.py",
           "in_prefix = k_pos[:, None, None, :] < prefix_len",
           "in_prefix = k_pos[:, None, None, :] <= prefix_len", "masks"),
    Mutant("rope_pairs_swapped", "transformers_jax/nn/positions/rope.py",
           "x1, x2 = rot_BTHR[..., 0::2], rot_BTHR[..., 1::2]",
           "x2, x1 = rot_BTHR[..., 0::2], rot_BTHR[..., 1::2]", "positions"),
    Mutant("alibi_slopes_shifted", "transformers_jax/nn/positions/alibi_bias.py",
           "return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)",
           "return 2.0 ** (-8.0 * np.arange(0, n) / n)", "positions"),
    Mutant("cache_positions_off_by_one", "transformers_jax/nn/kvcache.py",
           "positions_BT = cache.index[:, None] + jnp.arange(n_new, dtype=jnp.int32)[None, :]",
           "positions_BT = cache.index[:, None] + 1 + jnp.arange(n_new, dtype=jnp.int32)[None, :]",
           "decoding"),
    Mutant("scale_by_d_not_sqrt_d", "transformers_jax/nn/attention/api.py",
           "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)",
           "scale = 1.0 / q.shape[-1] if scale is None else float(scale)", "attention scaling"),
    Mutant("temperature_multiplies", "transformers_jax/sample.py",
           "scaled_BV = logits_BV / values.temperature",
           "scaled_BV = logits_BV * values.temperature", "sampling"),
    Mutant("nucleus_keeps_the_edge", "transformers_jax/sample.py",
           "((before_BV < p) | (p >= 1.0))", "((before_BV <= p) | (p >= 1.0))", "sampling"),
    Mutant("mlm_masks_at_random_rate", "transformers_jax/data/mlm.py",
           "to_mask_BT = chosen_BT & (u_BT < config.mask_fraction)",
           "to_mask_BT = chosen_BT & (u_BT < config.random_fraction)", "MLM masking"),
    Mutant("loss_counts_padding", "transformers_jax/learning/losses.py",
           "count = jnp.maximum(weights_BT.sum(), 1.0)",
           "count = jnp.maximum(float(weights_BT.size), 1.0)", "loss"),
    Mutant("adam_second_moment_b1", "transformers_jax/learning/optim.py",
           "v = jnp.where(keep, (1 - b2) * g ** 2 + b2 * v, v)",
           "v = jnp.where(keep, (1 - b1) * g ** 2 + b2 * v, v)", "optimiser"),
    Mutant("decay_on_every_parameter", "transformers_jax/learning/optim.py",
           "if decays and weight_decay:", "if weight_decay:", "optimiser"),
    Mutant("warmup_one_step_late", "transformers_jax/learning/optim.py",
           "warm = peak * (step + 1) / max(warmup, 1)", "warm = peak * step / max(warmup, 1)",
           "optimiser"),
]

TIERS = {"quick": ["-m", "not slow"], "full": []}


def scratch_tree(mutant: Mutant) -> Path:
    """A copy of the working tree (no .git, virtual environments or caches) with the bug."""
    folder = Path(tempfile.mkdtemp(prefix=f"tjax-mutant-{mutant.name}-"))
    ignore = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache",
                                    ".hypothesis", "runs", "*.egg-info", "sweeps", ".cache")
    shutil.copytree(ROOT, folder / "tree", ignore=ignore)
    target = folder / "tree" / mutant.path
    text = target.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: {mutant.old!r} occurs {text.count(mutant.old)} times "
                         f"in {mutant.path}, not once: update the mutant to the code")
    target.write_text(text.replace(mutant.old, mutant.new))
    return folder


def run_tier(tree: Path, tier: str, workers: int) -> tuple[str | None, float]:
    """(the first failing test's id or None, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               "-n", str(workers), "--dist", "loadfile", *TIERS[tier]]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        return None, seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    return (failed[0] if failed else f"exit {done.returncode}: {done.stdout[-300:]}"), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=["quick", "full", "both"], default="both")
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {m.area:18} {m.path}")
        return 0
    rows = []
    for mutant in chosen:
        folder = scratch_tree(mutant)
        try:
            row = {"mutant": mutant.name, "area": mutant.area}
            quick = None
            if args.tier in ("quick", "both"):
                quick, row["quick_s"] = run_tier(folder / "tree", "quick", args.workers)
                row["quick_killed_by"] = quick
            if args.tier == "full" or (args.tier == "both" and quick is None):
                row["full_killed_by"], row["full_s"] = run_tier(folder / "tree", "full",
                                                                args.workers)
            elif args.tier == "both":
                row["full_killed_by"] = quick  # the full suite holds every quick test
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| mutant | area | quick tier | full suite |\n|---|---|---|---|")
    for row in rows:
        cells = [row.get(f"{t}_killed_by", "-") for t in ("quick", "full")]
        shown = ["not run" if c == "-" else ("survives" if c is None else f"killed ({c})")
                 for c in cells]
        print(f"| {row['mutant']} | {row['area']} | {shown[0]} | {shown[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
