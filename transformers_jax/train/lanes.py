"""Lanes stepped together through one ``Program``: ``run_lanes`` is the loop, ``LanesRun`` the
state it carries between steps (what was timed, what is still to be checked), each stage of a
step one short method: the batches in and the step run, the log window, the evaluation, the
checkpoint, the stop.

``train`` drives one lane through its strategy's trainer (``solo_program``);
``train.seeds.train_seeds`` drives one lane per seed through one program whose state stacks
them all."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from tqdm import tqdm

from transformers_jax.evaluation import mean_metrics
from transformers_jax.learning import lora
from transformers_jax.learning.flops import device_peak, flops_per_token
from transformers_jax.learning.step import TrainState
from transformers_jax.models import family_of
from transformers_jax.nn.layers import count_params
from transformers_jax.parallel import multihost
from transformers_jax.parallel.strategies import ParallelTrainer
from transformers_jax.train.guard import NonFiniteError
from transformers_jax.train.lane import Lane, finish
from transformers_jax.train.profile import StepProfiler


def _window_metrics(rows: list[dict]) -> dict[str, float]:
    """Means over the window's applied (finite) steps, plus the count of skipped ones."""
    good = [r for r in rows if not int(r.get("nonfinite", 0))] or rows
    values = mean_metrics([{k: v for k, v in r.items() if k != "nonfinite"} for r in good])
    skipped = sum(int(r.get("nonfinite", 0)) for r in rows)
    return {**values, "skipped": skipped} if skipped else values


class StopSignals:
    """Turn SIGTERM/SIGINT (TPU preemption, Ctrl-C) into a request to save and stop cleanly.

    One process: a Python handler notes the signal. Several processes must stop after the same
    step, each saving its shards of one checkpoint; a signal reaches one host, or reaches hosts
    at different steps. So SIGTERM is left to JAX's preemption service (it tells every process
    and picks one step for all), and Ctrl-C is handed to it as a SIGTERM to this process.
    ``at(step)``, called once per step, says whether to stop after it and why.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}
        self._agreed = multihost.agrees_on_stops()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            signals = (signal.SIGINT,) if self._agreed else (signal.SIGTERM, signal.SIGINT)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        if self._agreed:  # through the preemption service, so that every process stops
            os.kill(os.getpid(), signal.SIGTERM)

    def at(self, step: int) -> str | None:
        if not self._agreed:
            return self.requested
        if not multihost.stop_agreed(step):
            return None
        return self.requested or "SIGTERM (on this or another process)"

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass(frozen=True)
class Program:
    """How ``run_lanes`` steps its lanes' states: one state through a strategy's trainer
    (``solo_program``), or the states of several seeds stacked on a leading axis and stepped
    as one program (``train.seeds``)."""

    trainer: ParallelTrainer  # its eval step, state shardings and mesh serve every lane
    place: Callable[[list[TrainState]], Any]  # the lanes' host states -> the program's state
    step: Callable[[Any, list[dict]], tuple[Any, dict]]  # (state, one host batch per lane)
    lane_state: Callable[[Any, int], TrainState]  # lane i's state, one copy of each array
    lane_params: Callable[[Any, int], Any]  # lane i's params as trainer.eval_step takes them
    lane_metrics: Callable[[dict, int], dict]  # lane i's values of a step's fetched metrics


def solo_program(trainer: ParallelTrainer) -> Program:
    """One run through ``trainer``'s strategy: ``train``'s program."""
    return Program(
        trainer,
        place=lambda states: trainer.place_state(states[0]),
        step=lambda state, batches: trainer.step(state, trainer.place_batch(batches[0],
                                                                            local=True)),
        lane_state=lambda state, _: trainer.unreplicate(state),
        lane_params=lambda state, _: state.params,
        lane_metrics=lambda row, _: row,
    )


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What each lane's step holds and costs, and the peak it is measured against: the start
    line's figures, each log window's MFU and the run's."""

    params: int
    trainable: int  # all of them, or a LoRA run's adapters
    flops: float  # model FLOPs per token
    flops_causal: float  # causal attention counted at half its full-context FLOPs (MaxText's)
    peak: float
    peak_source: str
    tokens_per_step: int  # each lane's

    @classmethod
    def of(cls, lanes: list[Lane], program: Program, state: TrainState) -> StepCost:
        cfg, model_cfg = lanes[0].cfg, lanes[0].setup.model_cfg
        peak, source = device_peak("bfloat16" if model_cfg.dtype == "bfloat16" else "float32")
        if cfg.strategy != "single":  # the whole mesh works on each step
            size = program.trainer.mesh.size
            peak, source = peak * size, f"{source}, x{size}"
        return cls(count_params(state.params), lora.trainable_count(state.params),
                   flops_per_token(model_cfg, cfg.seq_len),
                   flops_per_token(model_cfg, cfg.seq_len, causal_half=True), peak, source,
                   cfg.batch_size * cfg.seq_len)

    def mfu(self, tokens_per_s: float) -> dict[str, float]:
        return {"mfu": tokens_per_s * self.flops / self.peak,
                "mfu_causal_half": tokens_per_s * self.flops_causal / self.peak}


class LanesRun:
    """What ``run_lanes`` carries from one step to the next: the steps not yet checked, the
    log window and what has been timed. Each stage of a step is one method."""

    def __init__(self, lanes: list[Lane], program: Program, bar: tqdm, cost: StepCost):
        self.lanes, self.program, self.bar, self.cost = lanes, program, bar, cost
        self.cfg = lanes[0].cfg
        # one trace of the program (all lanes), in the first lane's run directory
        self.profiler = StepProfiler(
            self.cfg.profile, self.cfg.run_dir,
            lambda step, text, values: lanes[0].log.write("profile", step, values, text))
        self.start_step = 0
        # (step, metrics, each lane's data position before its batch): not yet checked
        self.pending: list[tuple[int, dict, list]] = []
        self.window: list[dict] = []  # the metrics of the steps since the last log line
        self.t_window = time.perf_counter()
        self.compile_s, self.timed_s, self.timed_steps = 0.0, 0.0, 0

    def start(self, states: list[TrainState]) -> Any:
        """Each lane's state to start from (a resume's, fine-tuning's or ``states``'), placed
        as the program's state, and each lane's start line."""
        lanes = self.lanes
        states = [lane.start(state, self.program.trainer)
                  for lane, state in zip(lanes, states, strict=True)]
        starts = [int(state.step) for state in states]
        if len(set(starts)) > 1:
            raise ValueError(
                "the runs are at different steps ("
                + ", ".join(f"{lane.cfg.run_dir}: {s}" for lane, s in zip(lanes, starts,
                                                                            strict=True))
                + "); runs trained together start from the same step: continue each alone "
                "(train) to the same step first, or train them separately")
        self.start_step = starts[0]
        state = self.program.place(states)
        self.bar.update(self.start_step)
        if skipped := self.profiler.skipped(self.start_step):  # a resume past the window
            lanes[0].log.write("profile", self.start_step, {}, skipped)
        self._announce()
        self.t_window = time.perf_counter()
        return state

    def _announce(self) -> None:
        cost, model_cfg, lanes = self.cost, self.lanes[0].setup.model_cfg, self.lanes
        cfg = self.cfg
        # LoRA: the model's own parameters frozen, the adapters trained
        trains = (f" ({cost.trainable:,} trainable: LoRA rank {cfg.lora.rank} on "
                  f"{','.join(cfg.lora.targets)}, {cost.params - cost.trainable:,} frozen)"
                  if cfg.lora.enabled else "")
        switches = "".join(f", {name}={getattr(model_cfg, name)}"
                           for name in ("attention", "mask", "position")
                           if name in family_of(model_cfg).switches)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        for lane in lanes:
            lane.started = started
            lane.log.write(
                "start", self.start_step,
                {"params": cost.params, "trainable_params": cost.trainable,
                 "flops_per_token": cost.flops, "flops_per_token_causal_half": cost.flops_causal,
                 "peak_flops": cost.peak},
                f"{model_cfg.family}: {cost.params / 1e6:.2f}M params{trains}{switches}"
                f"; data: {lane.data.description}; peak {cost.peak / 1e9:.0f} GFLOP/s "
                f"({cost.peak_source})"
                + (f"; seed {lane.cfg.seed}, one of {len(lanes)} trained together"
                   if len(lanes) > 1 else ""))

    def step(self, step: int, state: Any) -> Any:
        """Step ``step`` (from 0): each lane's next batch through the program. One step stays
        in flight, so the bar tracks finished steps."""
        positions = [lane.data.train.get_state() for lane in self.lanes]  # for spike warnings
        batches = [next(lane.data.train) for lane in self.lanes]
        start = time.perf_counter()
        with self.profiler.step(step):
            state, metrics = self.program.step(state, batches)
        self.profiler.after(step, state)
        if step == self.start_step:  # the first call compiles: kept out of the throughput
            jax.block_until_ready(state)
            self.compile_s = time.perf_counter() - start
            self.t_window = time.perf_counter()
        if self.window:
            jax.block_until_ready(self.window[-1]["loss"])
        self.window.append(metrics)
        self.pending.append((step + 1, metrics, positions))
        self.bar.update(1)
        return state

    def check_pending(self) -> None:
        """The guard's look at every step not yet checked (raises on a diverged one)."""
        rows = jax.device_get([metrics for _, metrics, _ in self.pending])
        for (step, _, positions), row in zip(self.pending, rows, strict=True):
            for i, lane in enumerate(self.lanes):
                with _naming(self.lanes, lane):
                    lane.guard.check(step, self.program.lane_metrics(row, i), positions[i])
        self.pending.clear()

    def log_window(self, done: int) -> None:
        """Each lane's log line for the window ending at step ``done``: mean metrics and the
        throughput of its timed steps."""
        rows = jax.device_get(self.window)  # waits for the queued steps
        self.check_pending()  # raises on a non-finite step past the skip budget
        elapsed = time.perf_counter() - self.t_window
        timed = len(rows) - (1 if done - len(rows) == self.start_step else 0)
        self.timed_s, self.timed_steps = self.timed_s + elapsed, self.timed_steps + timed
        tps = timed * self.cost.tokens_per_step / elapsed if timed and elapsed else 0.0
        for i, lane in enumerate(self.lanes):
            values = {**_window_metrics([self.program.lane_metrics(r, i) for r in rows]),
                      "tokens_per_s": tps, **self.cost.mfu(tps)}
            lane.history.append({"step": done, **values})
            lane.log.write("train", done, values,
                           f"step {done:>6} | loss {values['loss']:.4f} | lr "
                           f"{values['learning_rate']:.2e} | {tps:,.0f} tokens/s | MFU "
                           f"{100 * values['mfu']:.1f}%")
        loss = sum(lane.history[-1]["loss"] for lane in self.lanes) / len(self.lanes)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps * len(self.lanes):,.0f}")
        self.window, self.t_window = [], time.perf_counter()

    def evaluate(self, done: int, state: Any) -> None:
        jax.block_until_ready(state)  # queued train steps count as training time
        t_eval = time.perf_counter()
        program = self.program
        for i, lane in enumerate(self.lanes):
            lane.evaluate(done, program.trainer.eval_step, program.lane_params(state, i),
                          lambda i=i, s=state: program.lane_state(s, i).params)
        self.t_window += time.perf_counter() - t_eval  # eval time is not training throughput

    def save(self, done: int, state: Any) -> None:
        if all(lane.ckpt is None for lane in self.lanes):
            return
        self.check_pending()  # a diverged step raises here: nothing non-finite is ever saved
        for i, lane in enumerate(self.lanes):
            with _naming(self.lanes, lane):
                lane.save(done, self.start_step, self.program.lane_state(state, i))

    def stop(self, done: int, why: str) -> None:
        for lane in self.lanes:
            lane.log.write("stop", done, {}, f"{why}: saved step {done}, stopping; run the "
                           "same command again to resume")

    def results(self, state: Any, stopping: str | None) -> list[dict[str, Any]]:
        """Each lane's final metrics (logged, and its README written): ``train``'s answer."""
        self.profiler.close(state)  # a run that ended or stopped inside the profile window
        cost, final_step = self.cost, int(self.program.lane_state(state, 0).step)
        tokens_per_s = (self.timed_steps * cost.tokens_per_step / self.timed_s
                        if self.timed_s else 0.0)
        return [finish(lane, final_step, self.start_step, {
            "steps": final_step,
            "params": cost.params,
            "train_loss": lane.history[-1]["loss"] if lane.history else None,
            "eval_loss": lane.last_eval.get("loss"),
            "eval_accuracy": lane.last_eval.get("accuracy"),
            "tokens_per_s": tokens_per_s,
            "tokens_per_step": cost.tokens_per_step,
            **cost.mfu(tokens_per_s),
            "flops_per_token": cost.flops,
            "flops_per_token_causal_half": cost.flops_causal,
            "peak_flops": cost.peak,
            "peak_source": cost.peak_source,
            "compile_s": self.compile_s,
            "device": jax.devices()[0].device_kind,
            **({"seeds_together": len(self.lanes)} if len(self.lanes) > 1 else {}),
            "stopped_by": stopping if final_step < self.cfg.steps else None,
            "history": lane.history,
        }) for lane in self.lanes]

    def close(self) -> None:
        self.profiler.close()  # a run that failed inside the profile window
        for lane in self.lanes:
            if lane.ckpt is not None:
                lane.ckpt.close()  # waits for the last asynchronous save (the last good one)


def run_lanes(lanes: list[Lane], program: Program, states: list[TrainState], bar: tqdm,
              on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Train the lanes together from step 0 (``states``: their fresh states) or from their
    checkpoints, to ``cfg.steps``, through ``program``; each lane logs, evaluates, checkpoints
    and reports as a run of its own. The lanes share every setting but the seed and the run
    directory, so they log, evaluate and save at the same steps; they must start at the same
    step (``ValueError`` otherwise). Returns each lane's final metrics (``train``'s)."""
    cfg = lanes[0].cfg
    run = LanesRun(lanes, program, bar, StepCost.of(lanes, program, states[0]))
    try:
        state = run.start(states)
        stopping = None
        with StopSignals() as stop:
            for step in range(run.start_step, cfg.steps):
                state = run.step(step, state)
                done = step + 1
                stopping = stop.at(done)  # read once: a signal may land at any line below
                last = done == cfg.steps or stopping is not None
                if done % cfg.log_every == 0 or last:
                    run.log_window(done)
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    run.evaluate(done, state)
                if done % cfg.checkpoint_every == 0 or last:
                    run.save(done, state)
                if on_step is not None:
                    on_step(done)
                if stopping:
                    run.stop(done, stopping)
                    break
        return run.results(state, stopping)
    finally:
        run.close()


@contextlib.contextmanager
def _naming(lanes: list[Lane], lane: Lane):
    """A ``NonFiniteError`` of one of several lanes names its run."""
    try:
        yield
    except NonFiniteError as err:
        if len(lanes) == 1:
            raise
        name = lane.cfg.run_dir or f"seed {lane.cfg.seed}"
        raise NonFiniteError(f"{name}: {err}") from None
