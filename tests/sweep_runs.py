"""A helper the sweep's tests share: every seed run a sweep trains, recorded."""

from __future__ import annotations

import pytest

from transformers_jax.sweep import runner


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
