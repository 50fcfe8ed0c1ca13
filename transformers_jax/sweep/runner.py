"""Training and scoring a sweep's cells, resumably.

The output folder holds one folder per cell and one ordinary run directory per seed in it:

    OUT/cells/<cell>/cell.json        the cell's options, resolved configs, data digest, and
                                      the code that trained it
    OUT/cells/<cell>/seed<k>/         a run directory (tjax sample / eval / TensorBoard)
    OUT/cells/<cell>/seed<k>/sweep_done.json     written once the run reached its steps
    OUT/cells/<cell>/seed<k>/sweep_scores.json   its held-out scores, keyed by what decides them

A cell is claimed with a lock for as long as a process trains or scores it, so two workers
(or two machines writing to one folder) never train the same one. A sweep started again skips
what is done, resumes a run killed mid-way from its last checkpoint, and refuses a cell whose
recorded config or code differs from the one it would train now.

A cell with a parent starts from the parent's run of each seed, once every seed of it has
finished (it waits while another process trains the parent, and is left for a later pass when
none does). A fine-tune's seed folder is a run directory trained with ``--train.init_from``
the parent's, and ``sweep_from.json`` records which run of the parent it started from: a
parent trained again since is refused. A zero-shot cell's seed folders hold only scores, of
the parent's runs with the cell's model, keyed by the parent's run, so a parent trained
again is scored again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import time
import uuid
from collections.abc import Callable

from transformers_jax.config import TrainConfig
from transformers_jax.errors import RunFailedError
from transformers_jax.runs.lock import LOCK_FILE, RunDirLockedError, RunLock
from transformers_jax.study import provenance
from transformers_jax.sweep.plan import PlannedCell, SweepPlan
from transformers_jax.sweep.scores import Job, in_order
from transformers_jax.sweep.spec import SpecError

CELL_FILE, DONE_FILE, SCORES_FILE = "cell.json", "sweep_done.json", "sweep_scores.json"
FROM_FILE = "sweep_from.json"  # a fine-tune's seed: the parent run it started from
WAIT_SECONDS = 10.0  # how often a child looks again at a parent another process trains


class SweepStopped(RunFailedError):
    """A run stopped by a signal (Ctrl-C, a preemption): the sweep stops with it."""


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def cell_dir(out: str, planned: PlannedCell) -> str:
    return os.path.join(out, "cells", planned.cell.folder)


def seed_dir(out: str, planned: PlannedCell, seed: int) -> str:
    return os.path.join(cell_dir(out, planned), f"seed{seed}")


def parent_run(planned: PlannedCell, run_dir: str) -> str:
    """The run a child's seed folder ``run_dir`` starts from: the same seed's of the cell
    whose weights its parent holds (a zero-shot parent's: the cell that one scores)."""
    cells = os.path.dirname(os.path.dirname(run_dir))
    return os.path.join(cells, planned.parent.source.cell.folder, os.path.basename(run_dir))


# How a run reports, not what it trains: a setting added here later keeps the cells trained
# before it (their keys leave it out)
NOT_IN_KEY = frozenset({"json", "progress", "profile", "tensorboard", "wandb_project",
                        "log_every", "checkpoint_every", "keep_checkpoints"})


# Settings added to TrainConfig after sweeps began, left out of a cell's key while they hold
# the value every earlier run had: a library upgrade keeps the cells a sweep has finished.
ADDED_SINCE = ("lora", "data_download")


def cell_record(plan: SweepPlan, planned: PlannedCell) -> dict:
    """What decides a cell's runs: its configs and its data, and its parent's key (the
    key); and its code."""
    before = dataclasses.asdict(TrainConfig())
    train = {k: v for k, v in dataclasses.asdict(planned.train).items()
             if k not in NOT_IN_KEY and not (k in ADDED_SINCE and v == before[k])}
    decided = {"model": dataclasses.asdict(planned.model),
               "train": train, "data_sha256": plan.data_sha256,
               "heldout": [plan.spec.heldout_seed, plan.spec.heldout_bytes]}
    if planned.parent is not None:
        decided["parent"] = {"name": planned.parent.cell.name,
                             "key": cell_record(plan, planned.parent)["key"]}
        decided["zero_shot"] = planned.zero_shot
    if planned.zero_shot:
        command = None  # nothing trains: the parent's runs are scored with its model
    else:
        start = ([f"--train.init_from=OUT/cells/{planned.parent.source.cell.folder}/seedK"]
                 if planned.parent else [])
        command = shlex.join(["tjax", "train", *train_args(planned), *start])
    return {"name": planned.cell.name, "values": planned.cell.values, "command": command,
            "key": digest(decided), **decided}


def read_json(path: str) -> dict | None:
    """A JSON file's contents, or None where there is no such file."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_json(path: str, obj) -> None:
    """Written under a temporary name, then renamed: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


def check_cell(plan: SweepPlan, planned: PlannedCell, out: str, code: dict,
               allow_code_change: bool) -> dict:
    """The cell's record, written on first use; a recorded config or code that differs from
    now is refused (a code change only with ``allow_code_change``, then recorded)."""
    path = os.path.join(cell_dir(out, planned), CELL_FILE)
    record = cell_record(plan, planned)
    old = read_json(path)
    if old is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {**record, "code": [code]})
        return record
    if old["key"] != record["key"]:
        from transformers_jax.runs.checkpoint import config_differences

        if old.get("parent") and old["parent"] != record.get("parent"):
            raise SpecError(
                f"cell {planned.cell.name} in {out} started from the runs of "
                f"{old['parent']['name']} as that cell was configured then, and it has "
                f"changed since: a child never mixes parents; delete {os.path.dirname(path)} "
                "to redo it from the new runs, or use another --out")
        changed = config_differences({k: old.get(k) for k in ("model", "train")},
                                     {k: record[k] for k in ("model", "train")})
        changed += [] if old.get("data_sha256") == record["data_sha256"] else ["the data"]
        raise SpecError(
            f"cell {planned.cell.name} in {out} was trained with another config ("
            f"{'; '.join(changed[:4]) or 'the held-out split'}); a sweep never mixes runs: "
            f"use another --out, or delete {os.path.dirname(path)} to train it again")
    codes = old.get("code", [])
    if not any(provenance.same_code(c, code) for c in codes):
        if not allow_code_change:
            raise SpecError(
                f"cell {planned.cell.name} in {out} was trained by code "
                f"{provenance.describe(codes[-1]) if codes else 'unknown'}, and this is "
                f"{provenance.describe(code)}: a sweep never mixes code silently; check out "
                "that commit, use another --out, or pass --allow-code-change (recorded)")
        write_json(path, {**old, "code": [*codes, code]})
    return record


def train_args(planned: PlannedCell) -> list[str]:
    """The ``tjax train`` options that train one of the cell's runs alone: the cell's, with
    the data replaced by the split's training text and the budget the spec set."""
    args, skip = [], False
    for arg in planned.cell.args:
        if skip:
            skip = False
        elif arg in ("--data", "--train.data", "--steps", "--train.steps",
                     "--train.batch_size"):
            skip = True
        elif not arg.startswith(("--data=", "--train.data=", "--steps=", "--train.steps=",
                                 "--train.batch_size=")):
            args.append(arg)
    return [*args, f"--train.data={planned.train.data}", f"--steps={planned.train.steps}",
            f"--train.batch_size={planned.train.batch_size}"]


def finished(run_dir: str, steps: int) -> bool:
    done = read_json(os.path.join(run_dir, DONE_FILE))
    return done is not None and done.get("steps") == steps


def _step_now(run_dir: str) -> int:
    """The step a seed's run has reached (0 before its first checkpoint)."""
    from transformers_jax.runs.layout import has_checkpoints
    from transformers_jax.runs.meta import read_run_meta

    return int(read_run_meta(run_dir)["step"]) if has_checkpoints(run_dir) else 0


def together(planned: PlannedCell, run_dirs: list[str]) -> bool:
    """Whether these seeds can train as one program: a single-device run, every seed at the
    same step (``train_seeds``' conditions)."""
    cfg = planned.train
    single = cfg.strategy == "single" and cfg.mesh is None and cfg.coordinator is None
    return len(run_dirs) > 1 and single and len({_step_now(d) for d in run_dirs}) == 1


def train_seeds_of(planned: PlannedCell, seeds: list[int], run_dirs: list[str],
                   log: Callable[[str], None], apart: bool = False) -> None:
    """Train (or resume) these seeds' runs to their steps: as one program when they can
    (``train.seeds``), else one after another; each finished run gets its done file."""
    from transformers_jax.train.loop import train
    from transformers_jax.train.seeds import train_seeds

    args = train_args(planned)
    # a fine-tune: each seed from its parent's run of that seed
    starts = [parent_run(planned, d) if planned.parent else None for d in run_dirs]
    commands = [shlex.join(["tjax", "train", *args, f"--train.seed={s}", f"--run-dir={d}",
                            *([f"--train.init_from={i}"] if i else [])])
                for s, d, i in zip(seeds, run_dirs, starts, strict=True)]
    start = time.monotonic()
    if not apart and together(planned, run_dirs):
        log(f"cell {planned.cell.name}: seeds {seeds} as one program"
            + (", each from its parent's run of that seed" if planned.parent else ""))
        finals = train_seeds(planned.model, planned.train, seeds, run_dirs,
                             auto_vocab=planned.auto_vocab, command=commands,
                             init_from=starts if planned.parent else None)
    else:
        finals = [train(planned.model, planned.train.replace(run_dir=d, seed=s, init_from=i),
                        auto_vocab=planned.auto_vocab, command=c)
                  for s, d, i, c in zip(seeds, run_dirs, starts, commands, strict=True)]
    for seed, run_dir, final in zip(seeds, run_dirs, finals, strict=True):
        if final.get("stopped_by"):
            raise SweepStopped(f"{run_dir} stopped at step {final.get('steps')} "
                               f"({final['stopped_by']}); run the same tjax sweep command "
                               "again to resume it")
        summary = {"steps": planned.train.steps, "seed": seed, "run_id": uuid.uuid4().hex,
                   "seconds": round(time.monotonic() - start, 1),
                   **{k: v for k, v in final.items() if isinstance(v, (int, float, str))}}
        write_json(os.path.join(run_dir, DONE_FILE), summary)


def run_stamp(run_dir: str) -> str | None:
    """Which finished run ``run_dir`` holds (None: none yet): its done file's ``run_id``, new
    each time it is trained (a done file without one: its digest)."""
    done = read_json(os.path.join(run_dir, DONE_FILE))
    return None if done is None else done.get("run_id") or digest(done)


def score_key(plan: SweepPlan, planned: PlannedCell, scored_run: str | None = None) -> str:
    """What decides a seed's scores: the evaluation, the held-out text, the run's steps, and
    for a zero-shot cell which run of its parent it scored (``run_stamp``)."""
    decided = {"eval": plan.spec.eval_settings(), "heldout": plan.data_sha256,
               "steps": planned.train.steps, "tokens": int(plan.heldout_N.sum()),
               "n": int(plan.heldout_N.size)}
    if plan.context is not None:  # every token of the windows (the unigram draws follow the
        decided["context_windows"] = plan.context.digest  # training text, not the split)
    return digest({**decided, "scored_run": scored_run} if planned.zero_shot else decided)


def _seed_key(plan: SweepPlan, planned: PlannedCell, out: str, seed: int) -> str:
    if not planned.zero_shot:
        return score_key(plan, planned)
    return score_key(plan, planned, run_stamp(seed_dir(out, planned.source, seed)))


def scored_model(planned: PlannedCell, run_dir: str):
    """``(model, params, tokenizer)`` of the run ``run_dir``, as ``planned`` scores it: as
    trained, or for a zero-shot cell built from the cell's model config (the run's
    vocabulary kept) on the run's parameters."""
    from transformers_jax.models import build_model
    from transformers_jax.runs.load import load_run

    model, params, tokenizer, saved = load_run(run_dir)
    if planned.zero_shot:
        cfg = planned.model
        if planned.auto_vocab:
            cfg = cfg.replace(vocab_size=saved.vocab_size)
        model = build_model(cfg)
    return model, params, tokenizer


def score_seed(plan: SweepPlan, planned: PlannedCell, run_dir: str,
               key: str | None = None) -> dict:
    """One seed's scores: each score kind's table (``sweep/scores/``) that the spec asks for,
    such as the held-out loss at each evaluation length (its mean, its means over the held-out
    chunks, which pair cells, and the loss by position). A zero-shot cell passes its parent's
    run as ``run_dir`` (and the ``key`` that names it)."""
    model, params, tokenizer = scored_model(planned, run_dir)
    out: dict = {"key": key or score_key(plan, planned)}
    if planned.zero_shot:
        out.update(zero_shot=True, scored_run=os.path.abspath(run_dir))
    job = Job(plan, planned, model, params, tokenizer, run_dir)
    for kind in in_order():
        if kind.in_scores(plan.spec):
            out.update(kind.score(job))
    return out


def _same_scores(plan: SweepPlan, planned: PlannedCell, run_dir: str, key: str) -> dict | None:
    """A zero-shot cell whose model is the one its source run was trained as (no scaling,
    say) scores what that run scored: its scores, when they are there, under this cell's key."""
    if planned.model != planned.source.model:
        return None
    scores = read_json(os.path.join(run_dir, SCORES_FILE))
    if scores is None or scores.get("key") != score_key(plan, planned.source):
        return None
    return {**scores, "key": key, "zero_shot": True, "scored_run": os.path.abspath(run_dir)}


def parent_ready(plan: SweepPlan, planned: PlannedCell, out: str, log: Callable[[str], None],
                 wait_seconds: float = WAIT_SECONDS) -> bool:
    """Whether every seed of the run a child starts from has finished: it waits while
    another process holds that cell (trains or scores it), and is False when none does."""
    source = planned.parent.source
    lock_path = os.path.join(cell_dir(out, source), LOCK_FILE)
    said = False
    while True:
        if all(finished(seed_dir(out, source, s), source.train.steps)
               for s in plan.spec.seeds):
            return True
        if os.path.exists(lock_path):
            try:
                RunLock(cell_dir(out, source)).acquire().release()
            except RunDirLockedError:
                if not said:
                    log(f"cell {planned.cell.name}: waiting for {source.cell.name}, which "
                        "another process is training")
                    said = True
                time.sleep(wait_seconds)
                continue
        log(f"cell {planned.cell.name}: left for later, {source.cell.name} (its parent's "
            "runs) is not trained yet and no process is training it: run the shard that "
            "trains it, then this command again")
        return False


def _check_from(planned: PlannedCell, run_dir: str) -> None:
    """A fine-tune's seed: record the parent run it starts from, or refuse one that started
    from a run of the parent since trained again."""
    source = parent_run(planned, run_dir)
    path = os.path.join(run_dir, FROM_FILE)
    now = {"run": os.path.abspath(source), "run_id": run_stamp(source)}
    old = read_json(path)
    if old is None:
        os.makedirs(run_dir, exist_ok=True)
        write_json(path, now)
    elif old.get("run_id") != now["run_id"]:
        raise SpecError(
            f"cell {planned.cell.name}: {run_dir} was fine-tuned from {source} as it was "
            f"before that run was trained again; a sweep never mixes parents: delete "
            f"{os.path.dirname(run_dir)} to fine-tune it from the new run")


def run_cell(plan: SweepPlan, planned: PlannedCell, out: str, code: dict,
             allow_code_change: bool, log: Callable[[str], None], apart: bool = False) -> bool:
    """Train and score whatever the cell lacks; False when another process holds it, or when
    its parent is not trained and no process is training it."""
    check_cell(plan, planned, out, code, allow_code_change)
    if planned.parent is not None and not parent_ready(plan, planned, out, log):
        return False
    try:
        lock = RunLock(cell_dir(out, planned), log).acquire()
    except RunDirLockedError as err:
        log(f"skipping cell {planned.cell.name}: {err}")
        return False
    try:
        if planned.zero_shot:
            for seed in plan.spec.seeds:
                key = _seed_key(plan, planned, out, seed)
                scores_path = os.path.join(seed_dir(out, planned, seed), SCORES_FILE)
                old = read_json(scores_path)
                if old is None or old.get("key") != key:
                    source = seed_dir(out, planned.source, seed)
                    os.makedirs(os.path.dirname(scores_path), exist_ok=True)
                    write_json(scores_path, _same_scores(plan, planned, source, key)
                               or score_seed(plan, planned, source, key))
            return True
        key = score_key(plan, planned)
        if planned.parent is not None:
            for seed in plan.spec.seeds:
                _check_from(planned, seed_dir(out, planned, seed))
        missing = [s for s in plan.spec.seeds
                   if not finished(seed_dir(out, planned, s), planned.train.steps)]
        if missing:
            log(f"cell {planned.cell.name}: training seeds {missing}, {planned.train.steps} "
                f"steps ({planned.tokens:,} tokens) each, in {cell_dir(out, planned)}"
                + (f", from {planned.parent.source.cell.name}'s runs" if planned.parent
                   else ""))
            start, started = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%S")
            train_seeds_of(planned, missing, [seed_dir(out, planned, s) for s in missing], log,
                           apart)
            log(f"cell {planned.cell.name}: trained in {time.monotonic() - start:.1f} s")
            _record_work(out, planned, {"trained": missing, "started": started,
                                        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                        "code": provenance.describe(code)})
        for seed in plan.spec.seeds:
            run_dir = seed_dir(out, planned, seed)
            scores_path = os.path.join(run_dir, SCORES_FILE)
            old = read_json(scores_path)
            if old is None or old.get("key") != key:
                write_json(scores_path, score_seed(plan, planned, run_dir))
    finally:
        lock.release()
    return True


def _record_work(out: str, planned: PlannedCell, work: dict) -> None:
    """One more entry of the cell's work (which seeds were trained, when, by which code) in
    its ``cell.json``: a sweep's invocations each leave theirs."""
    path = os.path.join(cell_dir(out, planned), CELL_FILE)
    record = read_json(path) or {}
    write_json(path, {**record, "work": [*record.get("work", []), work]})


def read_scores(plan: SweepPlan, planned: PlannedCell, out: str) -> dict[int, dict]:
    """The seeds of a cell scored under this plan's evaluation (others are left out)."""
    found = {}
    for seed in plan.spec.seeds:
        scores = read_json(os.path.join(seed_dir(out, planned, seed), SCORES_FILE))
        if scores is not None and scores.get("key") == _seed_key(plan, planned, out, seed):
            found[seed] = scores
    return found
