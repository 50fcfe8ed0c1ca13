"""The non-finite guard and the loss-spike detector of a training run.

The jitted step (``learning.step.apply_gradients``) never applies an update whose loss or gradient
norm is not finite: params and optimizer state stay as they were, the step counter and the data
position advance, and the step reports ``nonfinite=1``. The loop hands every step's metrics to
``Guard.check`` on each logged step and before every save; the guard tolerates up to
``skip_nonfinite_steps`` such steps over the run (logging each) and then raises
``NonFiniteError``, so a diverged run stops before anything non-finite is saved.

``Guard`` also keeps an exponential moving average of the loss and warns when a step's loss
rises far above it (``SPIKE_*`` below), naming the step and where its batch is in the data
stream, so the batch can be read again (``data.train.set_state(position)``, then one ``next``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from transformers_jax.errors import NonFiniteError

__all__ = ["Guard", "NonFiniteError"]

SPIKE_DECAY = 0.98  # the EMA of the loss (and of its squared deviation) forgets at this rate
SPIKE_SIGMAS = 6.0  # a spike: loss above the EMA by this many running standard deviations ...
SPIKE_MIN_RISE = 0.25  # ... and by at least this fraction of the EMA
SPIKE_WARMUP = 20  # steps seen before any spike is reported (the early loss falls fast)


class Guard:
    """Checks each step's metrics (host values) in order; see the module docstring.

    ``warn(step, message)`` reports skips and spikes.
    """

    def __init__(self, skip_budget: int, warn: Callable[[int, str], None]):
        self.skip_budget, self.warn = skip_budget, warn
        self.skipped: list[int] = []  # steps (1-based: the update that would have made it)
        self.last_finite: tuple[int, float] | None = None  # (step, loss)
        self.spikes: list[int] = []
        self._ema: float | None = None
        self._var = 0.0
        self._seen = 0

    def check(self, step: int, metrics: dict[str, Any], position: Any = None) -> None:
        """``step``: the step count after this update; ``position``: the data iterator state
        just before this step's batch (for the spike warning)."""
        loss, norm = float(metrics["loss"]), float(metrics.get("grad_norm", 0.0))
        if metrics.get("nonfinite", 0) or not (math.isfinite(loss) and math.isfinite(norm)):
            self._nonfinite(step, loss, norm)
            return
        self.last_finite = (step, loss)
        self._spike(step, loss, position)

    def _nonfinite(self, step: int, loss: float, norm: float) -> None:
        self.skipped.append(step)
        if len(self.skipped) <= self.skip_budget:
            self.warn(step, f"step {step}: loss {loss} / grad norm {norm} is not finite; "
                      f"update skipped ({len(self.skipped)} of at most {self.skip_budget}, "
                      "train.skip_nonfinite_steps)")
            return
        last = (f"the last finite loss was {self.last_finite[1]:.4f} at step "
                f"{self.last_finite[0]}" if self.last_finite else "no finite loss was seen")
        budget = (f" after {self.skip_budget} skipped update(s) (steps "
                  f"{', '.join(map(str, self.skipped[:-1]))})" if self.skip_budget else "")
        raise NonFiniteError(
            f"training diverged at step {step}: loss {loss}, gradient norm {norm}{budget}; "
            f"{last}. Nothing non-finite was saved: the latest checkpoint is the last good "
            "one. Try a lower --train.learning_rate (or a longer --train.warmup_steps), "
            "--model.dtype=float32 instead of bfloat16, a tighter --train.grad_clip, or "
            "--train.skip_nonfinite_steps=N to skip a few bad batches"
        )

    def _spike(self, step: int, loss: float, position: Any) -> None:
        self._seen += 1
        if self._ema is None:
            self._ema = loss
            return
        rise = loss - self._ema
        if (self._seen > SPIKE_WARMUP and rise > SPIKE_SIGMAS * math.sqrt(self._var)
                and rise > SPIKE_MIN_RISE * abs(self._ema)):
            self.spikes.append(step)
            self.warn(step, f"step {step}: loss spike {loss:.4f} (moving average "
                      f"{self._ema:.4f}); its batch is the next one after data position "
                      f"{position}")
        self._ema += (1 - SPIKE_DECAY) * rise
        self._var = SPIKE_DECAY * (self._var + (1 - SPIKE_DECAY) * rise * rise)
