"""A ``jax.profiler`` trace of a window of training steps (``--train.profile=START:STEPS``).

The trace goes to ``RUN_DIR/profile`` (``PROFILE_DIR``); a run without a run directory
writes to a fresh temporary folder and says where. JAX lays it out as TensorBoard's profile
plugin reads it: ``profile/plugins/profile/<time>/<host>.xplane.pb`` (TensorBoard's profile tab,
``pip install tensorboard xprof``) beside ``<host>.trace.json.gz`` (Chrome trace JSON: opens in
https://ui.perfetto.dev). Each step of the window is a ``StepTraceAnnotation("train",
step_num=step)``, which the profile tab's step-time view and the trace viewer show per step.

Steps are numbered as the loop counts them, from 0: step 0 compiles, so a window from step 1
or later shows the steady state. The trace stops after the window's last step has finished on
the device (``jax.block_until_ready``), so its device work is in the trace; a run that ends or
stops inside the window stops the trace where it ends.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax

PROFILE_DIR = "profile"


def profile_window(spec: str | None) -> tuple[int, int] | None:
    """``"START:STEPS"`` -> ``(START, STEPS)`` (already checked by ``TrainConfig``)."""
    if spec is None:
        return None
    start, steps = spec.split(":")
    return int(start), int(steps)


def profile_dir(run_dir: str | None) -> str:
    """Where a trace goes: ``RUN_DIR/profile``, or a new temporary folder without a run."""
    if run_dir:
        return os.path.join(run_dir, PROFILE_DIR)
    return tempfile.mkdtemp(prefix="tjax-profile-")


class StepProfiler:
    """Starts a trace before step ``START``, annotates each step, and stops it once step
    ``START + STEPS - 1`` has finished. ``say(step, text, values)`` is called when the trace
    starts and when it stops (``values``: ``{"profile_dir": ...}``).

        profiler = StepProfiler(cfg.profile, cfg.run_dir, lambda step, text, values: print(text))
        for step in range(...):
            with profiler.step(step):
                state = train_step(state, batch)
            profiler.after(step, state)
        profiler.close(state)  # in a ``finally``: stops a trace the loop left running
    """

    def __init__(self, spec: str | None, run_dir: str | None,
                 say: Callable[[int, str, dict], None]):
        self.window = profile_window(spec)
        self.run_dir, self.say = run_dir, say
        self.log_dir: str | None = None
        self.active = False
        self.traced: list[int] = []  # the steps annotated so far

    @property
    def last(self) -> int | None:
        return None if self.window is None else self.window[0] + self.window[1] - 1

    def skipped(self, first_step: int) -> str | None:
        """Why nothing will be traced when the run starts at ``first_step`` (a resume past
        the window), else None."""
        if self.window is not None and first_step > self.window[0]:
            return (f"profile window starts at step {self.window[0]}, before this segment's "
                    f"first step {first_step}: nothing traced (give a later START)")
        return None

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """Enter around one training step: starts the trace at ``START`` and annotates the
        steps of the window."""
        if self.window is not None and step == self.window[0] and not self.active:
            self.log_dir = profile_dir(self.run_dir)
            jax.profiler.start_trace(self.log_dir)
            self.active = True
            self.say(step, f"profile: tracing steps {step}..{self.last} into {self.log_dir}",
                     {"profile_dir": self.log_dir})
        if not self.active:
            return contextlib.nullcontext()
        self.traced.append(step)
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs: Any) -> None:
        """After step ``step`` was dispatched: at the window's last step, wait for ``outputs``
        and stop the trace."""
        if self.active and step >= self.last:
            self.close(outputs)

    def close(self, outputs: Any = None) -> None:
        """Stop a running trace (after waiting for ``outputs``); nothing when none runs."""
        if not self.active:
            return
        self.active = False
        try:
            if outputs is not None:
                jax.block_until_ready(outputs)
        finally:
            jax.profiler.stop_trace()
        steps = f"{self.traced[0]}..{self.traced[-1]}" if self.traced else "none"
        self.say(self.traced[-1] if self.traced else 0,
                 f"profile: steps {steps} traced into {self.log_dir} (tensorboard --logdir "
                 f"{self.log_dir}: profile tab; or open plugins/profile/*/*.trace.json.gz in "
                 "https://ui.perfetto.dev)", {"profile_dir": self.log_dir})
