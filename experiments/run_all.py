"""Run every ablation experiment, then rebuild ``experiments/README.md`` from the results.

    python -m experiments.run_all                      # default scale (a 2-core CPU)
    python -m experiments.run_all --scale large        # accelerator-sized runs
    python -m experiments.run_all --only attention_variants
    python -m experiments.run_all --rebuild-only       # only regenerate the README
    python -m experiments.run_all --replot             # every table and plot from its JSON,
                                                       # then the README (trains nothing)

An interrupted run continues where it stopped: finished experiments are skipped and the
wired ones reload their finished runs from ``results/.cache/`` (``--fresh`` redoes all).

Each experiment runs as its own process (``python -m experiments.NAME --scale S``), so the
command recorded above each results table is the one that produced it. The README is generated
here, from ``results/*.json`` and ``results/*.md``: a section per experiment with what it
tests, the published result it should echo, the exact command, our tables and plot, and a short
finding computed from the numbers. Edit this file, not the README.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")
SHOWN_SCALES = ("default", "large")  # tiny results are smoke tests, never shown


def _results_dir() -> str:
    from experiments import common

    return common.RESULTS


# ------------------------------------------------------------------------------ helpers


def _mean(values) -> float:
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return float(np.mean(xs)) if xs else float("nan")


def _paired(comparisons: dict, key: str, published_sign: int) -> str | None:
    """"d [low, high]: verdict" for a stored paired interval (None when not stored)."""
    from experiments.stats import Interval, verdict

    iv = comparisons.get(key)
    if iv is None:
        return None
    if math.isnan(iv["mean"]):
        return "n/a (a run diverged or was not scored)"
    interval = Interval.from_dict(iv)
    return f"{interval} nats: {verdict(interval, published_sign)}"


def _equivalent(iv: dict, margin: float) -> str:
    """An equivalence reading of a paired interval: "as published" when it lies within
    +-``margin``, "unlike the paper" when it lies wholly beyond, else "inconclusive"."""
    if math.isnan(iv["mean"]):
        return "n/a (a run diverged or was not scored)"
    low, high = iv["low"], iv["high"]
    said = ("as published" if -margin < low and high < margin else
            "unlike the paper" if low > margin or high < -margin else "inconclusive")
    return f"{iv['mean']:+.3f} [{low:+.3f}, {high:+.3f}] nats: {said}"


def _listing(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


# ------------------------------------------------------------------------------ findings


def finding_attention_heads(out: dict) -> str:
    res = out["results"]
    batches = out["decode_batches"]
    big = f"batch_{batches[-1]}"
    loss = {k: _mean(r["eval_loss"] for r in v["runs"]) for k, v in res.items()}
    speed = {k: v["decode"][big]["decode_tokens_per_s"] for k, v in res.items()}
    ref = "MHA" if "MHA" in res else next(iter(res))
    parts = ["Held-out loss: " + _listing([f"{k} {loss[k]:.3f}" for k in res])
             + f"; decode tokens/s at batch {batches[-1]}: "
             + _listing([f"{k} {speed[k]:,.0f} (x{speed[k] / speed[ref]:.2f})" for k in res])
             + "."]
    gqa = [k for k in res if k.startswith("GQA")]
    if gqa and "MQA" in res and ref == "MHA":
        g = gqa[0]
        near_q = abs(loss[g] - loss["MHA"]) <= 0.02 * loss["MHA"]
        gap = speed["MQA"] - speed["MHA"]
        frac = (speed[g] - speed["MHA"]) / gap if abs(gap) > 1e-9 else float("nan")
        parts.append(f"{g} is {'within' if near_q else 'not within'} 2% of MHA's loss "
                     f"({loss[g] - loss['MHA']:+.3f} nats) and recovers "
                     + (f"{100 * frac:.0f}%" if not math.isnan(frac) else "n/a")
                     + " of MHA's speed gap to MQA.")
        comparisons = out.get("comparisons", {})
        margin = 0.02 * loss["MHA"]
        # the paper: GQA keeps MHA's quality (47.1 vs 47.2: an equivalence claim, read within
        # the 2% margin above), MQA loses a little (46.6: a sign claim)
        said = [f"{k} {_equivalent(comparisons[f'{k} - MHA'], margin)}" for k in gqa
                if f"{k} - MHA" in comparisons]
        if "MQA - MHA" in comparisons:
            said.append(f"MQA {_paired(comparisons, 'MQA - MHA', +1)}")
        grams = {k: v for k, v in out.get("baselines", {}).items() if k.endswith("-gram")}
        best = min(grams, key=grams.get) if grams else None
        if best is not None and min(loss.values()) >= grams[best]:
            # a model that has not learned what an n-gram knows says nothing about attention
            parts.append(f"No model is past the {best} fitted on the same training text "
                         f"({grams[best]:.3f} nats), so the losses cannot be set beside "
                         "Ainslie et al.'s: the paired differences are not read as claims.")
        elif said:
            parts.append(f"Loss minus MHA's, paired over seeds and held-out chunks (95%; GQA "
                         f"\"as published\" when the interval lies within +-{margin:.3f} nats, "
                         "MQA when it is worse): " + _listing(said) + ".")
        d = out.get("decode", {})
        if d and all("kv_cache_bytes_per_token" in v for v in res.values()):
            slots = batches[-1] * (d["prompt_len"] + d["new_tokens"])
            mb = {k: v["kv_cache_bytes_per_token"] * slots / 2**20 for k, v in res.items()}
            parts.append(f"Each decoded token reads the whole KV cache: at batch {batches[-1]} "
                         f"with {d['prompt_len'] + d['new_tokens']} slots that is "
                         + _listing([f"{mb[k]:.1f} MiB for {k}" for k in res]) + ".")
        if speed["MQA"] < 1.05 * speed["MHA"]:
            parts.append("At this size decoding is not bound by reading the KV cache, so "
                         "sharing k/v heads buys little speed; the gain grows with batch, "
                         "context and model size (Ainslie et al. measure it on T5-XXL).")
    parts.append("Published (Ainslie et al. 2023): GQA near MHA quality at close to MQA "
                 "speed.")
    return " ".join(parts)


# ------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Section:
    name: str  # results file stem before _<scale>
    title: str | None  # subsection title (None: the experiment's only result)
    finding: Callable[[dict], str]


@dataclass(frozen=True)
class Experiment:
    module: str
    title: str
    tests: str
    published: str
    sections: tuple[Section, ...]
    runtime: str
    superseded_by: str | None = None  # the sweep under results/sweeps/ that replaces it
    # (spec file in experiments/specs/, what it measures): the sweeps that took over parts of
    # it, each shown by its report once one is committed, else by its command
    specs: tuple[tuple[str, str], ...] = ()


EXPERIMENTS = (
    Experiment(
        "attention_variants", "Attention variants",
        "MHA vs GQA vs MQA: held-out loss after the same training, and KV-cache decoding speed "
        "(tokens/s at batch 1 and a larger batch, long cache) with the cache bytes per token. "
        "The script's other parts (sliding windows, prefix-LM vs causal LM, QK-norm and "
        "soft-capping under a learning-rate sweep) are sweeps only, listed below; their old "
        "results on the built-in corpus: `git show 030c6ad:experiments/README.md`.",
        "Ainslie et al. 2023 (GQA, T5-XXL; time per sample / average score): MHA 1.51 s / 47.2, "
        "GQA-8 0.28 s / 47.1, MQA 0.24 s / 46.6: GQA keeps MHA quality at close to MQA speed.",
        (Section("attention_variants_heads", None, finding_attention_heads),),
        "9 text runs of 2.0M tokens (3 seeds), about 65 s each on 2 quiet CPU cores, then "
        "decoding timed on each model; the committed runs trained on one core beside another "
        "experiment (2026-12-04, 15 min), their decoding re-timed on 2 quiet cores; resumable",
        specs=(("attention_variants.toml", "the heads' loss at matched parameters, and sliding "
                "windows"),
               ("attention_prefix.toml", "prefix-LM vs causal LM"),
               ("attention_stability.toml", "stability, each rate against the variant's own "
                "converged loss")),
    ),
)


# ------------------------------------------------------------------------------ README


def _load(results: str, stem: str, scale: str) -> tuple[dict, str] | None:
    base = os.path.join(results, f"{stem}_{scale}")
    if not (os.path.exists(base + ".json") and os.path.exists(base + ".md")):
        return None
    with open(base + ".json") as f:
        payload = json.load(f)
    with open(base + ".md") as f:
        table = f.read().strip()
    return payload, table


def _scale_flag(scale: str) -> str:
    return "" if scale == "default" else f" --scale {scale}"


UNSHUFFLED_CAVEAT = (
    "**Caveat.** Trained with the packed rows unshuffled (`--shuffle-rows 0`; the default "
    "until 2026-12-03): each batch held mostly one document's neighbouring windows, which "
    "slows training (length extrapolation, L=128, same budget: NoPE 2.25 -> 1.76 nats "
    "held-out with rows shuffled, RoPE 1.31 -> 1.21). Not yet re-run with the default.")


def build_readme(results: str, readme: str = README) -> str:
    """The README text from whatever results exist in ``results``; written to ``readme``."""
    rel = os.path.relpath(results, os.path.dirname(os.path.abspath(readme)))
    lines = [
        "# Experiments",
        "",
        "Ablations that each train small models from scratch and compare one switch at a time,",
        "checked against a published result. Every result below is regenerated from",
        f"`{rel}/` by `python -m experiments.run_all --rebuild-only` (this file is generated:",
        "edit `experiments/run_all.py`, not this README); `--replot` also redraws every",
        "table and plot from its JSON, training nothing. Run everything with",
        "`python -m experiments.run_all [--scale default|large]`, or one experiment with the",
        "command in its section. Scales: `tiny` (smoke tests, never shown here), `default`",
        "(minutes on a 2-core CPU; small models, so the findings are indicative, not",
        "conclusive) and `large` (an accelerator-sized run of the same protocol).",
        "",
        "Each run writes `NAME_SCALE.json` (all numbers, the command, JAX version and device),",
        "`NAME_SCALE.md` (the tables below, headed by the exact command) and `NAME_SCALE.png`.",
        "The findings are computed from the JSON by `run_all.py`, so they always describe the",
        "numbers shown, including when those numbers disagree with the paper.",
        "",
    ]
    for i, exp in enumerate(EXPERIMENTS, 1):
        lines.append(f"{i}. [{exp.title}](#{i}-{_anchor(exp.title)})")
    lines.append("")
    lines += _sweep_reports(results, rel)
    for i, exp in enumerate(EXPERIMENTS, 1):
        command = f"python -m experiments.{exp.module}"
        lines += [f"## {i}. {exp.title}", ""]
        if exp.superseded_by:
            lines += [f"**Superseded** by the sweep [`{exp.superseded_by}`]({rel}/sweeps/"
                      f"{exp.superseded_by}/report.md) on the research corpus; the results "
                      "below were trained on the built-in corpus, whose held-out text leaks "
                      "into training.", ""]
        lines += [
            f"**What it tests.** {exp.tests}",
            "",
            f"**Published result to echo.** {exp.published}",
            "",
            f"**Command.** `{command}` (default scale: {exp.runtime}); "
            f"`{command} --scale large` for the full run. Source: "
            f"[`{exp.module}.py`]({exp.module}.py).",
            "",
        ]
        if exp.specs:
            lines += ["**Sweeps** on the research corpus (docs/experiments.md): "
                      + "; ".join(_spec_entry(results, rel, spec, what)
                                  for spec, what in exp.specs) + ".", ""]
        for section in exp.sections:
            if section.title:
                lines += [f"### {section.title}", ""]
            shown = False
            for scale in SHOWN_SCALES:
                loaded = _load(results, section.name, scale)
                if loaded is None:
                    continue
                payload, table = loaded
                shown = True
                heading = "####" if section.title else "###"
                lines += [f"{heading} Results ({scale} scale)", "", table, ""]
                png = os.path.join(results, f"{section.name}_{scale}.png")
                if os.path.exists(png):
                    lines += [f"![{section.name} ({scale})]({rel}/{section.name}_{scale}.png)",
                              ""]
                lines += [f"**Finding.** {section.finding(payload)}", ""]
                if payload.get("shuffle_rows") == 0:  # text trained on unshuffled rows
                    lines += [UNSHUFFLED_CAVEAT, ""]
            if not shown:
                lines += [f"Not run yet: `{command}`", ""]
    text = "\n".join(lines).rstrip() + "\n"
    with open(readme, "w") as f:
        f.write(text)
    return text


def _spec_entry(results: str, rel: str, spec: str, what: str) -> str:
    """A spec's report once committed under ``results/sweeps/``, else the command to run it."""
    name = spec.removesuffix(".toml")
    if os.path.exists(os.path.join(results, "sweeps", name, "report.md")):
        return f"{what}: [report]({rel}/sweeps/{name}/report.md) (`experiments/specs/{spec}`)"
    return (f"{what}: `tjax sweep experiments/specs/{spec} --out sweeps/{name}` "
            "(not yet run)")


def _sweep_reports(results: str, rel: str) -> list[str]:
    """A list of the committed ``tjax sweep`` reports (``results/sweeps/NAME/report.md``), each
    with its title and the command heading it."""
    root = os.path.join(results, "sweeps")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    reports = [n for n in names if os.path.exists(os.path.join(root, n, "report.md"))]
    if not reports:
        return []
    lines = ["Sweeps on the research corpus (`tjax sweep`, docs/experiments.md): each report "
             "lists every cell against the n-gram baselines and every declared comparison, "
             "under the one command that regenerates it. An experiment rewritten as a spec "
             "lives only here: its spec in `experiments/specs/`, its report below.", ""]
    for name in reports:
        with open(os.path.join(root, name, "report.md")) as f:
            text = f.read()
        title = text.splitlines()[0].lstrip("# ").strip()
        command = re.search(r"^Command: (`[^`]+`)", text, re.M)
        lines.append(f"- [{title}]({rel}/sweeps/{name}/report.md)"
                     + (f": {command.group(1)}" if command else ""))
    return [*lines, ""]


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


# ------------------------------------------------------------------------------ main


def _done_key(name: str, scale: str) -> str:
    """What a finished experiment depended on: its source, the shared code, the scale."""
    import hashlib

    digest = hashlib.sha256(scale.encode())
    for part in (f"{name}.py", "common.py", "splits.py", "stats.py", "ngram.py"):
        path = os.path.join(HERE, part)
        if os.path.exists(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:20]


def run_experiments(names: list[str], scale: str, results: str,
                    fresh: bool = False) -> dict[str, dict]:
    """Run each experiment as its own process from the repository root, writing to
    ``results``; returns the exit status and wall time of each. An experiment that finished
    with the same code and scale is skipped (``results/.cache/run_all.json``), and wired
    experiments resume inside from their per-run cache, so an interrupted ``run_all``
    continues where it stopped; ``fresh`` recomputes everything."""
    root = os.path.dirname(HERE)
    env = {**os.environ, "TJAX_RESULTS_DIR": os.path.abspath(results)}
    if fresh:
        env["TJAX_FRESH"] = "1"
    done_path = os.path.join(results, ".cache", "run_all.json")
    done = {}
    if os.path.exists(done_path) and not fresh:
        with open(done_path) as f:
            done = json.load(f)
    status = {}
    for name in names:
        key = f"{name}/{scale}"
        if done.get(key) == _done_key(name, scale):
            print(f"== {name}: finished before with this code and scale; skipped", flush=True)
            status[name] = {"returncode": 0, "wall_s": 0.0, "skipped": True}
            continue
        cmd = [sys.executable, "-m", f"experiments.{name}", "--scale", scale]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd, cwd=root, env=env)
        status[name] = {"returncode": rc, "wall_s": time.perf_counter() - start}
        print(f"== {name}: exit {rc} after {status[name]['wall_s'] / 60:.1f} min", flush=True)
        if rc == 0:
            done[key] = _done_key(name, scale)
            os.makedirs(os.path.dirname(done_path), exist_ok=True)
            with open(done_path, "w") as f:
                json.dump(done, f, indent=1)
    return status


def replot_experiments(names: list[str], scale: str, results: str) -> dict[str, dict]:
    """``python -m experiments.NAME --scale S --replot`` for each experiment with results at
    ``scale`` in ``results``; the others are skipped."""
    root = os.path.dirname(HERE)
    env = {**os.environ, "TJAX_RESULTS_DIR": os.path.abspath(results)}
    status = {}
    for name in names:
        if not glob.glob(os.path.join(results, f"{name}_*{scale}.json")):
            print(f"== {name}: no {scale} results in {results}; nothing to replot", flush=True)
            continue
        cmd = [sys.executable, "-m", f"experiments.{name}", "--scale", scale, "--replot"]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL)
        status[name] = {"returncode": rc, "wall_s": 0.0}
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="default", choices=("tiny", "default", "large"))
    parser.add_argument("--only", default=None,
                        help="comma-separated experiments to run (default: all)")
    parser.add_argument("--rebuild-only", action="store_true",
                        help="only regenerate the README from the existing results")
    parser.add_argument("--replot", action="store_true",
                        help="train nothing: rebuild every experiment's tables and plots from "
                        "its results JSON (after a change to a report or plot), then the README")
    parser.add_argument("--results", default=None, help="results folder (default: "
                        "$TJAX_RESULTS_DIR or experiments/results)")
    parser.add_argument("--readme", default=README)
    parser.add_argument("--fresh", action="store_true",
                        help="rerun finished experiments and cached runs")
    args = parser.parse_args(argv)
    results = args.results or _results_dir()
    if args.replot and args.rebuild_only:
        parser.error("--replot already rebuilds the README: give one of --replot, "
                     "--rebuild-only")
    names = [e.module for e in EXPERIMENTS]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown experiments {unknown}; valid: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    status = {}
    if args.replot:
        status = replot_experiments(names, args.scale, results)
    elif not args.rebuild_only:
        status = run_experiments(names, args.scale, results, args.fresh)
    build_readme(results, args.readme)
    print(f"wrote {args.readme}")
    failed = [n for n, s in status.items() if s["returncode"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
