"""Side by side with PyTorch, each contender in a process of its own: our JAX model, Hugging
Face ``GPT2LMHeadModel``, and a plain PyTorch GPT (``torch_gpt.py``, fused
``scaled_dot_product_attention``, optionally ``torch.compile``), on the same weights, the same
batches, the same optimizer and learning-rate schedule.

This driver imports neither jax nor torch. It prepares the shared inputs once (a JAX process:
``side_by_side_jax.py prepare``), then runs the contenders in rounds, A B C A B C ..., each run
a fresh Python process (``side_by_side_jax.py run`` never imports torch,
``side_by_side_torch.py`` never imports jax), with an environment from which every thread and
OpenMP setting is removed (``THREAD_VARIABLES``), so each library runs with its own defaults.
Alternating whole processes lets a drift in the machine's load hit every contender; the
figures are the median of the rounds, with their min, max and every round's value, and each
ratio is the median of the per-round ratios. The load average is recorded at the start and end
of every process and of the whole run.

In every process: training tokens/s (forward + backward + AdamW on ``B x T`` tokens; the
median step time after ``--warmup`` untimed steps) and greedy decoding tokens/s with a KV cache
at each decoding batch (``generate`` for Hugging Face, our compiled loop, the plain GPT's own
loop; prefill included; median of ``--decode-repeats`` after one warm-up call).

Correctness, checked in every run and alone with ``--check`` (no timing; exits 1 on a
mismatch): the losses of the first ``--check-steps`` steps of every float32 contender within
``--loss-tolerance`` (relative) of ours, and the greedy tokens identical.

    python benchmarks/side_by_side.py --shape a --rounds 5 --out sbs_a.json --markdown sbs_a.md
    python benchmarks/side_by_side.py --shape b      # config b as a BERT masked LM (ours, HF)
    python benchmarks/side_by_side.py --check --shape tiny       # correctness only, seconds
    python benchmarks/side_by_side.py --no-train --contenders hf,jax_float32@1,hf@1
                                # decoding, each also pinned to one core (NAME@N: N cores)
    python benchmarks/side_by_side.py --shape tiny --rounds 2    # a smoke run of the timing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from side_by_side_shared import (  # noqa: E402
    JAX_CONTENDERS,
    KIND_CONTENDERS,
    MALLOC_VARIABLES,
    SHAPES,
    THREAD_VARIABLES,
    describe_machine,
    machine_facts,
)

# name -> (script, arguments): every contender the driver knows.
CONTENDERS = {
    **{name: ("side_by_side_jax.py", args) for name, args in JAX_CONTENDERS.items()},
    "hf": ("side_by_side_torch.py", ["--impl", "hf"]),
    "torch": ("side_by_side_torch.py", ["--impl", "torch"]),
    # torch.compile: the model for training, the fixed-shape decoding step for decoding
    "torch_compile": ("side_by_side_torch.py", ["--impl", "torch", "--compile"]),
}
REFERENCE = "jax_float32"  # "ours" in every ratio
# float32: losses and tokens must match
EXACT = (*(name for name in JAX_CONTENDERS if "float32" in name), "hf", "torch",
         "torch_compile")


def worker_environment() -> dict:
    """The driver's environment without thread, wait or malloc settings (each worker starts
    from its library's defaults; ours then sets its malloc as tjax does), with this checkout
    first on ``PYTHONPATH`` (the workers import its ``transformers_jax``)."""
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARIABLES, *MALLOC_VARIABLES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def parse_contender(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name@N``: the contender, and the number of cores it is pinned to (None:
    the whole machine, as its users run it)."""
    name, _, cores = spec.partition("@")
    if not cores:
        return name, None
    if not cores.isdigit() or not 1 <= int(cores) <= (os.cpu_count() or 1):
        raise ValueError(f"contender {spec!r}: after '@' give a core count from 1 to "
                         f"{os.cpu_count()} (the cores it is pinned to)")
    return name, int(cores)


def run_worker(script: str, arguments: list[str], log, timeout: float,
               cores: int | None = None) -> dict:
    """One worker process; ``cores``: pinned to the first ``cores`` CPUs this driver may use
    (XLA and PyTorch both size their thread pools to the affinity they start with)."""
    command = [sys.executable, os.path.join(HERE, script), *arguments]
    busy_before, children_before = busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    pin = None
    if cores is not None:  # this driver runs no threads, so setting it in the child is safe
        chosen = set(sorted(os.sched_getaffinity(0))[:cores])
        pin = lambda: os.sched_setaffinity(0, chosen)  # noqa: E731
    start = time.perf_counter()
    done = subprocess.run(command, env=worker_environment(), capture_output=True, text=True,
                          timeout=timeout, check=False, preexec_fn=pin)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError as err:  # a worker that printed nothing, or not only its JSON
        raise RuntimeError(f"{' '.join(command)} printed no JSON object ({err}); its stdout "
                           f"ends: {done.stdout[-200:]!r}\n{done.stderr[-3000:]}") from err
    result["process_wall_s"] = wall
    # The share of the machine other processes used while this worker ran: the machine's busy
    # CPU time minus the worker's own, over wall time x CPUs. (The load average cannot tell:
    # the worker's own threads raise it to about the CPU count.)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (children.ru_utime + children.ru_stime) - (children_before.ru_utime
                                                     + children_before.ru_stime)
    busy_after = busy_cpu_seconds()
    result["other_cpu_share"] = (None if busy_before is None else max(
        0.0, (busy_after - busy_before - own) / (wall * (os.cpu_count() or 1))))
    share = result["other_cpu_share"]
    result["pinned_cores"] = cores
    log(f"  {script} {' '.join(arguments[:4])}"
        + ("" if cores is None else f" (pinned to {cores} core(s))") + f": {wall:.1f} s"
        + ("" if share is None else f", other processes {share:.0%} of the CPUs"))
    return result


def spread(values: list[float]) -> dict:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else None,
            "per_round": values}


def speeds(runs: list[dict]) -> dict:
    """Per figure (training, decoding batch b): the tokens/s of every round."""
    out = {}
    if all("training" in r and "tokens_per_s" in r["training"] for r in runs):
        out["training_tokens_per_s"] = [r["training"]["tokens_per_s"] for r in runs]
    for key in runs[0].get("decoding", {}):
        if all("tokens_per_s" in r.get("decoding", {}).get(key, {}) for r in runs):
            out[f"decode_{key}_tokens_per_s"] = [r["decoding"][key]["tokens_per_s"] for r in runs]
    return out


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def correctness(first: dict, check_steps: int, tolerance: float) -> dict:
    """Each contender's first-round losses and greedy tokens against ``REFERENCE``'s."""
    reference = first[REFERENCE]
    out = {"reference": REFERENCE, "check_steps": check_steps, "loss_tolerance": tolerance}
    passed = True
    for name, result in first.items():
        if name == REFERENCE:
            continue
        entry = {"exact_expected": parse_contender(name)[0] in EXACT}
        if "training" in result and "training" in reference:
            ours, theirs = reference["training"]["losses"], result["training"]["losses"]
            n = min(check_steps, len(ours))
            entry["loss_relative_gap_first_steps"] = relative_gap(theirs[:n], ours[:n])
            entry["loss_relative_gap_all_steps"] = relative_gap(theirs, ours)
            entry["final_loss"] = theirs[-1]
            entry["losses_match"] = entry["loss_relative_gap_first_steps"] <= tolerance
        for key, decoded in result.get("decoding", {}).items():
            mine, ref = decoded["tokens"], reference["decoding"][key]["tokens"]
            same = [a == b for row_a, row_b in zip(mine, ref, strict=True)
                    for a, b in zip(row_a, row_b, strict=True)]
            entry[f"greedy_tokens_identical_{key}"] = sum(same) / len(same)
        if entry["exact_expected"]:
            passed &= entry.get("losses_match", True) and all(
                v == 1.0 for k, v in entry.items() if k.startswith("greedy_tokens_identical"))
        out[name] = entry
    out["passed"] = passed
    return out


def summarise(runs: dict) -> dict:
    """Median, min, max and per-round values of every figure; ratios ours / theirs as the
    median of the per-round ratios."""
    figures = {name: speeds(rs) for name, rs in runs.items()}
    out = {name: {key: spread(values) for key, values in fs.items()}
           for name, fs in figures.items()}
    ratios = {}
    for name, fs in figures.items():
        if name == REFERENCE:
            continue
        for key, values in fs.items():
            if key in figures.get(REFERENCE, {}):
                per_round = [a / b for a, b in zip(figures[REFERENCE][key], values, strict=True)]
                ratios[f"{REFERENCE}_vs_{name}_{key.removesuffix('_tokens_per_s')}"] = \
                    spread(per_round)
    return {"per_contender": out, "ratios": ratios}


def step_times_ms(runs: dict) -> dict:
    """Every timed training step of every process, in ms, per contender and round: whether a
    slow round was slow throughout (the process) or in bursts (the machine)."""
    return {name: [[round(1e3 * s, 2) for s in r["training"]["step_s"]] for r in rs]
            for name, rs in runs.items() if all("step_s" in r.get("training", {}) for r in rs)}


def markdown(result: dict) -> str:
    summary = result["summary"]["per_contender"]
    keys = sorted({k for fs in summary.values() for k in fs},
                  key=lambda k: (not k.startswith("training"), k))
    head = "| contender | " + " | ".join(k.removesuffix("_tokens_per_s").replace("_", " ") +
                                        " tokens/s, median [min-max]" for k in keys) + " |"
    lines = [head, "|---" * (len(keys) + 1) + "|"]
    for name, fs in summary.items():
        cells = [f"{fs[k]['median']:,.0f} [{fs[k]['min']:,.0f}-{fs[k]['max']:,.0f}]"
                 if k in fs else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio ours / theirs (median of per-round ratios) | median | min | max |",
              "|---|---|---|---|"]
    for name, r in result["summary"]["ratios"].items():
        lines.append(f"| {name} | {r['median']:.2f}x | {r['min']:.2f}x | {r['max']:.2f}x |")
    load = result["load_average_start"][0], result["load_average_end"][0]
    shares = [x for xs in result.get("other_cpu_share_per_process", {}).values() for x in xs
              if x is not None]
    other = f"; other processes used at most {max(shares):.1%} of the CPUs during a worker" \
        if shares else ""
    machine = (f"; machine: {describe_machine(result['machine'])}, {result['cpu_count']} CPUs"
               if "machine" in result else "")
    lines += ["", f"Shape {result['shape']['name']}, rounds: {result['rounds']}, "
              f"load average (1 min, the workers' own threads included) {load[0]:.1f} -> "
              f"{load[1]:.1f}{other}{machine}; command: `{result['command']}`"]
    if result.get("machine_was_busy"):
        lines += ["", "**The machine was busy during this run (other processes used more than "
                  "10% of the CPUs): not figures to quote.**"]
    return "\n".join(lines) + "\n"


def plot_losses(first: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in first.items():
        if "training" in result:
            ax.plot(result["training"]["losses"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title("training loss: same weights, batches, optimizer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="a")
    parser.add_argument("--tiny", action="store_true", help="same as --shape tiny")
    parser.add_argument("--contenders", default="jax_float32,hf,torch,torch_compile",
                        help=f"comma-separated, from {', '.join(CONTENDERS)}; "
                        f"{REFERENCE} is always run")
    parser.add_argument("--rounds", type=int, default=5, help="processes of each contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed training steps")
    parser.add_argument("--timed-steps", type=int, default=30, help="timed training steps")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads in the torch workers (default: torch's own)")
    parser.add_argument("--torch-tjax-malloc", action="store_true",
                        help="give the torch workers the malloc setting tjax uses for itself "
                        "(transformers_jax/backends/cpu_malloc.py; default: the system's)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="correctness only: one untimed process per contender; exit 1 on a "
                        "mismatch")
    parser.add_argument("--check-steps", type=int, default=10)
    parser.add_argument("--loss-tolerance", type=float, default=1e-3)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--dir", help="keep the prepared inputs here (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--markdown", help="also write a markdown table here")
    parser.add_argument("--plot", help="PNG of the first round's loss curves")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    shape = "tiny" if args.tiny else args.shape
    names = [REFERENCE] + [n for n in filter(None, args.contenders.split(",")) if n != REFERENCE]
    try:
        specs = {n: parse_contender(n) for n in names}
    except ValueError as e:
        parser.error(str(e))
    unknown = [n for n in names if specs[n][0] not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}: choose from {', '.join(CONTENDERS)} "
                     "(each may end in @N: pinned to N cores)")
    kind = SHAPES[shape]["kind"]
    if args.contenders == parser.get_default("contenders"):  # the default: all that apply
        names = [n for n in names if n in KIND_CONTENDERS[kind]]
    wrong = [n for n in names if specs[n][0] not in KIND_CONTENDERS[kind]]
    if wrong:
        parser.error(f"contenders {wrong} cannot run shape {shape} (a {kind}): choose from "
                     f"{', '.join(KIND_CONTENDERS[kind])}")
    rounds = 1 if args.check else args.rounds
    steps = args.check_steps if args.check else args.warmup + args.timed_steps
    if args.check and args.no_train and args.no_decode:
        parser.error("--check with --no-train and --no-decode checks nothing")

    def log(message):
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {message}",
                  file=sys.stderr, flush=True)

    result = {"command": "python benchmarks/side_by_side.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "load_average_start": list(os.getloadavg()), "cpu_count": os.cpu_count(),
              "machine": machine_facts(),
              "mode": "check" if args.check else "timed", "rounds": rounds,
              "order": "each round runs every contender once, in this order, one process each",
              "contenders": names,
              "worker_environment_removed": [*THREAD_VARIABLES, *MALLOC_VARIABLES]}
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or scratch
        log(f"preparing {shape} ({steps} steps) in {directory}")
        run_worker("side_by_side_jax.py", ["prepare", "--dir", directory, "--shape", shape,
                                           "--steps", str(steps), "--seed", str(args.seed),
                                           "--learning-rate", str(args.learning_rate)],
                   log, args.timeout)
        with open(os.path.join(directory, "plan.json")) as f:
            plan = json.load(f)
        common = ["--dir", directory, "--warmup", str(args.warmup),
                  "--decode-repeats", str(args.decode_repeats)]
        common += ["--check"] if args.check else []
        common += ["--no-train"] if args.no_train else []
        common += ["--no-decode"] if args.no_decode else []
        runs = {name: [] for name in names}
        for i in range(rounds):
            log(f"round {i + 1}/{rounds}")
            for name in names:
                base, cores = specs[name]
                script, extra = CONTENDERS[base]
                torch_side = script == "side_by_side_torch.py"
                settings = (["--threads", str(args.torch_threads)]
                            if args.torch_threads and torch_side else [])
                settings += ["--tjax-malloc"] if args.torch_tjax_malloc and torch_side else []
                runs[name].append(run_worker(script, [*extra, *common, *settings], log,
                                             args.timeout, cores))
    first = {name: rs[0] for name, rs in runs.items()}
    result["shape"] = plan["shape"]
    result["steps_per_process"] = steps
    result["warmup_steps"] = 0 if args.check else args.warmup
    result["optimizer"] = plan["optimizer"]
    result["objective"], result["data"] = plan["objective"], plan["data"]
    result["correctness"] = correctness(first, args.check_steps, args.loss_tolerance)
    result["losses_first_round"] = {n: r["training"]["losses"] for n, r in first.items()
                                    if "training" in r}
    result["isolation"] = {n: {"jax_imported": r.get("jax_imported"),
                               "torch_imported": r.get("torch_imported")}
                           for n, r in first.items()}
    result["threads"] = {n: r["threads"] for n, r in first.items()}
    result["pinned_cores"] = {n: specs[n][1] for n in names}  # None: the whole machine
    # glibc malloc of each worker: ours as tjax runs (transformers_jax/backends/cpu_malloc.py)
    result["host_malloc"] = {n: r.get("host_malloc") for n, r in first.items()}
    result["versions"] = {n: r["versions"] for n, r in first.items()}
    result["worker_thread_environment"] = {n: r["process_start"]["thread_environment"]
                                           for n, r in first.items()}
    result["load_average_per_process"] = {
        n: [[r["process_start"]["load_average"][0], r["process_end"]["load_average"][0]]
            for r in rs] for n, rs in runs.items()}
    result["process_wall_s"] = {n: [r["process_wall_s"] for r in rs] for n, rs in runs.items()}
    if not args.check:
        result["summary"] = summarise(runs)
        # ours: lower + compile of the train step; PyTorch: its first step (torch.compile's
        # compilation happens there), per round
        result["training_compile_or_first_step_s"] = {
            n: [r["training"].get("compile_s", r["training"].get("first_step_s")) for r in rs]
            for n, rs in runs.items() if "training" in rs[0]}
        result["training_step_ms_per_process"] = step_times_ms(runs)
    result["load_average_end"] = list(os.getloadavg())
    result["other_cpu_share_per_process"] = {n: [r["other_cpu_share"] for r in rs]
                                             for n, rs in runs.items()}
    shares = [x for xs in result["other_cpu_share_per_process"].values() for x in xs
              if x is not None]
    # PyTorch's default OpenMP wait spins: on an oversubscribed machine its processes slow down
    # far more than ours, so figures from a busy machine say little about either library. Busy:
    # other processes took more than 10% of the CPUs while some worker ran (where /proc/stat
    # tells; elsewhere the load average at the start, before any worker, above half the CPUs).
    busiest = max(shares) if shares else None
    result["machine_was_busy"] = (busiest > 0.10 if busiest is not None else
                                  result["load_average_start"][0] > 0.5 * (os.cpu_count() or 1))
    if result["machine_was_busy"] and not args.check:
        log(f"warning: other processes used up to {busiest:.0%} of the CPUs during a worker: "
            "measure on a quiet machine before quoting these figures" if busiest is not None
            else "warning: the machine was loaded at the start: measure on a quiet machine")
    if args.plot:
        plot_losses(first, args.plot)
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.markdown and not args.check:
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
    print(text)
    if not result["correctness"]["passed"]:
        log("correctness check FAILED: " + json.dumps(result["correctness"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
