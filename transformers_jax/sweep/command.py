"""``tjax sweep SPEC.toml --out DIR``: train every cell of a spec for every seed, score them on
one held-out text, and write the report (``report.py``). ``--dry-run`` prints the cells, their
budgets and the time they should take here; ``--workers N`` trains N cells at once on this
host; ``--shard i/n`` trains every n-th cell, for machines sharing one output folder."""

from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import sys
import tempfile
import time

from transformers_jax.overrides import CommandParser
from transformers_jax.study import provenance
from transformers_jax.study.workers import (
    parse_shard,
    run_shards,
    without_option,
    worker_cores,
)
from transformers_jax.sweep import power
from transformers_jax.sweep.plan import PlannedCell, SweepPlan, make_plan
from transformers_jax.sweep.report import fitted_baselines, write_report
from transformers_jax.sweep.runner import CELL_FILE, cell_dir, read_json, run_cell
from transformers_jax.sweep.spec import SpecError, read_spec


def sweep_parser() -> CommandParser:
    parser = CommandParser(
        "tjax sweep", "Run an ablation from a TOML spec: each cell of its axes trained for "
        "each seed (every run an ordinary run directory), scored on held-out text no cell "
        "trains on, against n-gram baselines, with every comparison the spec declares, "
        "Holm-corrected. Started again, it trains only what is missing. The spec's keys: "
        "docs/experiments.md.")
    parser.add_argument("spec", help="the spec, a TOML file")
    parser.add_argument("--out", required=True, help="the sweep's folder (cells, report)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cells, their budgets and estimated time; train nothing")
    parser.add_argument("--workers", type=int, default=1,
                        help="cells trained at once on this host, each in its own process")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="train only cells I, I+N, I+2N, ... (several machines, one --out)")
    parser.add_argument("--depth", type=int, default=None, metavar="D",
                        help="only the cells D steps from scratch (0: trained from scratch, 1: "
                        "their fine-tune and zero-shot children, ...); --workers runs the "
                        "depths one after another")
    parser.add_argument("--seeds-apart", action="store_true",
                        help="train a cell's seeds one after another (default: as one program "
                        "on one device, each equal to training it alone)")
    parser.add_argument("--allow-code-change", action="store_true",
                        help="train with uncommitted changes, or beside cells trained by "
                        "other code (recorded in results.json)")
    parser.add_argument("--reanalyse", action="store_true",
                        help="rebuild OUT's report and results.json from the scores it stores, "
                        "with the spec's claims as they are now: nothing trained or scored")
    parser.add_argument("--accept-low-power", action="store_true",
                        help="run a design whose primary claims have under 50%% power at "
                        "their stated effect, from the [pilot] (recorded in results.json)")
    return parser


def _step_seconds(planned: PlannedCell, tokenizer) -> float:
    """The median time of a training step of this cell's shape on this machine."""
    import jax

    from transformers_jax.bench import training_setup

    model = planned.model
    if planned.auto_vocab:
        model = model.replace(vocab_size=tokenizer.vocab_size)
    batch = None
    if planned.train.task:  # the task's own rows (prefix lengths, encoder rows)
        from transformers_jax.sweep.tasks import train_batch

        batch = train_batch(model, planned.train, tokenizer)
    step, state, batch = training_setup(model, planned.train, batch=batch)
    state, _ = step(state, batch)  # compile
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _eval_seconds(planned: PlannedCell, plan: SweepPlan, cache: dict) -> float:
    """The time scoring one seed of this cell should take here: one batch of windows timed
    at each length (sliding too), times the batches the held-out stream makes; and the
    context windows' batches, intact and perturbed (truncated ones timed at full length)."""
    spec = plan.spec
    model = planned.model
    if planned.auto_vocab:
        model = model.replace(vocab_size=plan.tokenizer.vocab_size)
    if spec.task is not None:  # a batch of test examples per task length, the longest rows
        return _task_seconds(planned, model, plan, cache) * len(spec.task.lengths)
    slid = {x.text for x in spec.sliding_lengths}
    total = 0.0
    for x, length in zip(spec.lengths, planned.lengths(spec), strict=True):
        strides = [length] + ([min(spec.stride.resolve(planned.reference_len), length)]
                              if x.text in slid else [])
        for stride in strides:
            batches = -(-len(range(0, plan.heldout_N.size - length, stride))
                        // spec.eval_batch_size)
            total += _batch_seconds(model, length, spec.eval_batch_size, cache) * batches
    if plan.context is not None:
        batches = -(-spec.context.windows // spec.eval_batch_size) * (
            1 + len(plan.context.perturbed))
        total += _batch_seconds(model, plan.context.window, spec.eval_batch_size,
                                cache) * batches
    return total


def _task_seconds(planned: PlannedCell, model, plan: SweepPlan, cache: dict) -> float:
    """Seconds scoring one task length takes: the test batch of the longest length through
    the forward pass exact match reads (compiled), kept in ``cache`` by the model's shape."""
    import jax

    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.models import build_model
    from transformers_jax.sweep.tasks import exact_logits, row_tokens, test_batch

    task, settings = planned.train.task, plan.spec.task
    key = (_shape_key(model), task)
    if key not in cache:
        longest = max(settings.lengths)
        batch = test_batch(task, model.family, plan.tokenizer, longest,
                           row_tokens(task, model.family, longest), settings.examples,
                           settings.seed, model.mask.needs_prefix_len)
        module = build_model(model)
        params = objective_for(model.family).init_params(module, jax.random.key(0), batch)
        forward = jax.jit(lambda p, b: exact_logits(module, p, b))
        jax.block_until_ready(forward(params, batch))  # compile
        start = time.perf_counter()
        jax.block_until_ready(forward(params, batch))
        cache[key] = time.perf_counter() - start
    return cache[key]


def _batch_seconds(model, length: int, batch_size: int, cache: dict) -> float:
    """Seconds one batch of windows of ``length`` takes to score (compiled), kept in
    ``cache`` by the model's shape."""
    import jax
    import numpy as np

    from transformers_jax.evaluation import window_losses
    from transformers_jax.models import build_model

    key = (_shape_key(model), length)
    if key not in cache:
        module = build_model(model)
        windows = np.zeros((batch_size, length + 1), np.int32)
        params = module.init(jax.random.key(0), windows[:1, :8])["params"]
        losses = window_losses(module)
        jax.block_until_ready(losses(params, windows))  # compile
        start = time.perf_counter()
        jax.block_until_ready(losses(params, windows))
        cache[key] = time.perf_counter() - start
    return cache[key]


def _shape_key(model) -> str:
    """A model's config with its RoPE scaling left out (the scalings cost about the same)."""
    position = model.position
    if hasattr(position, "scaling"):
        position = dataclasses.replace(position, scaling=type(position)().scaling)
    return repr(model.replace(position=position))


def dry_run(plan: SweepPlan) -> None:
    spec = plan.spec
    data = plan.data_record()
    print(f"{len(plan.cells)} cells x {len(spec.seeds)} seeds = "
          f"{len(plan.cells) * len(spec.seeds)} runs; {len(plan.pairs)} comparisons declared")
    if spec.task is not None:
        print(f"data {data['corpus']}: {spec.task.examples} test examples at each of "
              f"{len(spec.task.lengths)} task lengths")
    else:
        more = "" if data["training_tokens_complete"] else "the first "
        print(f"data {data['corpus']}: {more}{data['training_tokens']:,} training tokens, "
              f"{data['heldout_tokens']:,} held out ({data['overlap']['share']:.2%} of "
              f"held-out {data['overlap']['window_bytes']}-byte windows also in training)")
    # a task draws fresh examples: epochs of text only
    epochs = (lambda p: "-") if spec.task is not None else (
        lambda p: f"{p.tokens_seen / data['training_tokens']:.2f}")
    shapes: dict[str, float] = {}
    scoring: dict = {}
    total = scored = 0.0
    print(f"{'cell':<40} {'steps':>7} {'batch':>5} {'seq':>5} {'tokens':>12} {'epochs':>6} "
          f"{'s/step':>7} {'est. min':>8} {'score min':>9}  from")
    for planned in plan.cells:
        seconds, step = 0.0, 0.0
        if not planned.zero_shot:
            key = repr((_shape_key(planned.model), planned.train.batch_size,
                        planned.train.seq_len))
            if key not in shapes:
                shapes[key] = _step_seconds(planned, plan.tokenizer)
            step = shapes[key]
            seconds = step * planned.train.steps * len(spec.seeds)
        scoring_s = _eval_seconds(planned, plan, scoring) * len(spec.seeds)
        total += seconds
        scored += scoring_s
        source = "" if planned.parent is None else (
            f"{planned.parent.cell.name} ({'zero-shot' if planned.zero_shot else 'fine-tune'})")
        print(f"{planned.cell.name:<40} {planned.train.steps if step else 0:>7} "
              f"{planned.train.batch_size if step else 0:>5} "
              f"{planned.train.seq_len:>5} {planned.tokens:>12,} "
              f"{epochs(planned):>6} {step:>7.3f} "
              f"{seconds / 60:>8.1f} {scoring_s / 60:>9.1f}  {source}")
    print(f"estimated training time here: {total / 60:.1f} min for all seeds (measured step "
          f"times; compiles add to it); scoring: {scored / 60:.1f} min (one timed batch per "
          f"length); together {(total + scored) / 60:.1f} min")
    for pair in plan.pairs:
        print(f"compare {pair.index}: {pair.title}" + (f"  ({pair.claim})" if pair.claim else ""))
    rows = design(plan)
    for line in power.describe(rows, len(spec.seeds)):
        print(line)
    if power.low_power(rows):
        print("a run would be refused: " + ", ".join(
            f"compare {r['compare']} has {r['power']:.0%} power" for r in power.low_power(rows))
            + " (--accept-low-power runs it anyway)")
    for control, cells in plan.controls:
        print(f"control {control.index}: {control.text} in every seed of "
              f"{', '.join(c.name for c in cells)}"
              + (f"  ({control.claim})" if control.claim else ""))


def design(plan: SweepPlan) -> list[dict]:
    """What each comparison can detect, from the spec's ``[pilot]`` (``sweep/power.py``)."""
    path = power.pilot_path(plan.spec)
    return power.design(plan, power.read_pilot(path) if path else None)


def run_workers(argv: list[str], workers: int, plan: SweepPlan, depth: int | None) -> None:
    """``workers`` processes of this command, each with ``--shard i/workers``, depth by depth
    (every parent has finished before its children start; fewer workers where a depth has
    fewer cells); returns when all have finished (stopping the rest if one fails)."""
    start = "from transformers_jax.cli import main; raise SystemExit(main())"
    command = [sys.executable, "-c", start, "sweep",
               *without_option(without_option(argv, "--workers"), "--depth")]
    depths = sorted({p.depth for p in plan.cells}) if depth is None else [depth]
    for d in depths:
        n = max(min(workers, sum(p.depth == d for p in plan.cells)), 1)
        failed = run_shards([*command, *([f"--depth={d}"] if len(depths) > 1 or depth is not
                                          None else [])], worker_cores(n))
        if failed:
            raise SpecError(f"worker {', '.join(failed)} failed (its output is above); "
                            "finished runs are kept, so the same command resumes")


def _other_code(plan: SweepPlan, out: str, code: dict) -> list[dict]:
    seen = []
    for planned in plan.cells:
        record = read_json(os.path.join(cell_dir(out, planned), CELL_FILE)) or {}
        for c in record.get("code", []):
            if not provenance.same_code(c, code) and c not in seen:
                seen.append(c)
    return seen


def typed_command(argv: list[str], cwd: str) -> str:
    """The command heading the report, as it would be typed in ``cwd``: a path argument under
    ``cwd`` given absolute is written relative to it, so the command reruns from any checkout
    of the repository, not only from the machine that ran it."""

    def typed(arg: str) -> str:
        option, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if os.path.isabs(value) and os.path.commonpath([value, cwd]) == cwd:
            value = os.path.relpath(value, cwd)
        return option + eq + value

    return shlex.join(["tjax", "sweep", *map(typed, argv)])


def main(argv: list[str]) -> int:
    args, _, _ = sweep_parser().parse(argv)
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be at least 1")
    shard = parse_shard(args.shard)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    spec = read_spec(args.spec)
    if spec.max_seeds is not None:  # seeds = "auto": as many as the primary claims need
        spec = power.resolve_seeds(spec, power.read_pilot(power.pilot_path(spec)))
        print(f"seeds = \"auto\": {len(spec.seeds)} seeds (of at most {spec.max_seeds})",
              file=sys.stderr)
    if args.reanalyse:
        from transformers_jax.sweep.reanalyse import reanalyse

        reanalyse(spec, args.out, typed_command(argv, os.getcwd()))
        print(f"{args.out}: report.md and results.json rebuilt from the stored scores",
              file=sys.stderr)
        return 0
    if args.dry_run:  # the split is made, but in a folder that goes away
        with tempfile.TemporaryDirectory() as tmp:
            dry_run(make_plan(spec, tmp))
        return 0
    code = provenance.code_state()
    if code["dirty"] and not args.allow_code_change:
        raise SpecError(f"the checkout at {os.path.dirname(provenance.PACKAGE_DIR)} has "
                        "uncommitted changes to the package: results must come from committed "
                        "code; commit them, or pass --allow-code-change (recorded)")
    plan = make_plan(spec, os.path.join(args.out, "data"))
    rows = design(plan)
    if not args.accept_low_power:
        power.refuse_low_power(rows, len(spec.seeds))
    os.makedirs(args.out, exist_ok=True)
    command = typed_command(argv, os.getcwd())
    record = {"code": code, "allow_code_change": args.allow_code_change,
              "versions": provenance.versions(), "host": provenance.host(),
              "data": plan.data_record(), "spec_file": spec.path, "spec": spec.text,
              "started": started,
              **({"design": rows, "low_power_accepted": bool(power.low_power(rows))}
                 if spec.pilot else {})}
    base, own = fitted_baselines(plan, args.out)

    def report() -> None:
        write_report(plan, args.out, {**record, "other_code": _other_code(plan, args.out, code),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")},
                     command, base, own)

    if args.workers > 1 and shard is None:
        run_workers(argv, args.workers, plan, args.depth)
    else:
        skipped = []
        mine = [p for p in plan.cells if args.depth is None or p.depth == args.depth]
        for k, planned in enumerate(mine):  # parents first
            if shard is not None and k % shard[1] != shard[0]:
                continue
            if run_cell(plan, planned, args.out, code, args.allow_code_change, _log,
                        args.seeds_apart):
                report()
            else:
                skipped.append(planned.cell.name)
        if skipped:
            _log(f"{len(skipped)} cell(s) were in use by another process, or wait for a "
                 "parent no process is training, and are not in this report yet: run the "
                 "command again when those have finished")
    report()
    _log(f"wrote {os.path.join(args.out, 'report.md')} and results.json")
    return 0


def _log(text: str) -> None:
    print(f"tjax sweep: {text}", file=sys.stderr, flush=True)
