"""Helpers the sweep's tests share: a clean checkout faked, every seed run a sweep trains
recorded."""

from __future__ import annotations

import pytest

# A one-layer GPT of 16 wide trained on 1536 tokens at length 32: seconds a run
from transformers_jax.study import provenance
from transformers_jax.sweep import command, report, runner

TINY_BASE = """[base]
args = ["--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2", "--train.seq_len=32",
  "--train.batch_size=4", "--train.eval_every=1000", "--train.checkpoint_every=1000",
  "--train.log_every=1000", "--train.tensorboard=false"]
tokens = 1536
"""
# two seeds of two cells on a 4,000-byte held-out split: what the sweep tests' specs share
TINY_CELLS = """
seeds = 2

""" + TINY_BASE + """
[axes]
"model.position" = ["rope", "alibi"]

[heldout]
bytes = 4000
"""


def clean_checkout(mp: pytest.MonkeyPatch, tmp_path) -> dict:
    """A committed, clean code state for the sweep (tests run from any checkout) and a split
    cache of the test's own; returns the code state the sweep will record."""
    mp.setenv("TJAX_SPLIT_CACHE", str(tmp_path / "splits"))
    code = {"commit": "a" * 40, "dirty": False, "source_sha256": "1" * 64}
    mp.setattr(provenance, "code_state", lambda: dict(code))
    return code


def record_trained(mp: pytest.MonkeyPatch) -> list[str]:
    """``cell/seed`` for each seed the sweep trains from now on (``runner.train_seeds_of``
    still trains it)."""
    calls: list[str] = []
    real = runner.train_seeds_of

    def counted(planned, seeds, run_dirs, log, apart=False):
        calls.extend(f"{planned.cell.name}/{seed}" for seed in seeds)
        return real(planned, seeds, run_dirs, log, apart)

    mp.setattr(runner, "train_seeds_of", counted)
    return calls


def plots_at_the_end(mp: pytest.MonkeyPatch) -> None:
    """Each ``tjax sweep`` draws its plots in its last report only, not in the report it
    rewrites after every cell as well: the plots of every finished cell are drawn once a
    command (a figure saved is about 0.25 s of CPU, and these tests read the last report)."""
    real_plots, real_run_cell = report.plots, command.run_cell
    after_cell = [False]

    def run_cell(*args, **kwargs):
        after_cell[0] = real_run_cell(*args, **kwargs)
        return after_cell[0]

    def plots(plan, results, out):
        if after_cell[0]:  # the report right after a cell: the command's last one draws them
            after_cell[0] = False
            return []
        return real_plots(plan, results, out)

    mp.setattr(command, "run_cell", run_cell)
    mp.setattr(report, "plots", plots)
