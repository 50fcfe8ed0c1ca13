"""Shared pieces of the ablation experiments: training runs, held-out evaluation at any length,
and writing results (JSON, a markdown table headed by the exact command, a PNG plot)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.config import SHUFFLE_ROWS
from transformers_jax.loop import train
from transformers_jax.runs import load_run
from transformers_jax.study.workers import own_cores
from transformers_jax.sweep.plan import token_stream

RESULTS = os.environ.get("TJAX_RESULTS_DIR", os.path.join(os.path.dirname(__file__), "results"))
FRESH = os.environ.get("TJAX_FRESH", "") not in ("", "0")  # ignore cached runs
_STARTED = time.monotonic()  # the experiment process started about here: its measured time


def elapsed_s() -> float:
    """Seconds since this experiment process started."""
    return time.monotonic() - _STARTED


def cache_key(**parts) -> str:
    """A stable hash of everything that decides a run's numbers (configs, data, eval)."""

    def plain(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return plain(x.to_dict() if hasattr(x, "to_dict") else dataclasses.asdict(x))
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    text = json.dumps(plain(parts), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_run(experiment: str, key: str, compute: Callable[[], dict]) -> dict:
    """``compute()`` once per ``key``: its JSON-able result is kept under
    ``results/.cache/<experiment>/`` so an interrupted experiment (or ``run_all``) resumes at
    the first run it had not finished. ``TJAX_FRESH=1`` (``--fresh``) recomputes."""
    path = os.path.join(RESULTS, ".cache", experiment, f"{key}.json")
    if not FRESH and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, default=float)
    os.replace(tmp, path)  # a run killed mid-write leaves no half file
    return result


def command_line() -> str:
    """The command that produced a result, as a user would type it."""
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    module = os.path.splitext(os.path.relpath(sys.argv[0]))[0].replace(os.sep, ".")
    return f"python -m {module} {args}".strip()


def add_shuffle_rows_option(parser) -> None:
    """``--shuffle-rows N``: the packed training rows are shuffled within windows of N rows
    (``TrainConfig.shuffle_rows``; default: the library's, ``SHUFFLE_ROWS``; 0 trains on
    unshuffled rows, as the results committed until 2026-12-03 were)."""
    parser.add_argument("--shuffle-rows", type=int, default=None,
                        help=f"shuffle the packed training rows within windows of this many "
                             f"(TrainConfig.shuffle_rows; default {SHUFFLE_ROWS}; 0: off, as "
                             "the results committed until 2026-12-03)")


def resolved_shuffle_rows(shuffle_rows: int | None) -> int:
    """What ``TrainConfig`` trains text with for ``--shuffle-rows`` (recorded in the JSON):
    its own resolution of the default, not a copy of the rule."""
    return TrainConfig(shuffle_rows=shuffle_rows).shuffle_rows


def rows_line(shuffle_rows: int) -> str:
    """How the training rows were ordered, for a table's heading."""
    if shuffle_rows > 1:
        return f"training rows shuffled in windows of {shuffle_rows} (--shuffle-rows)"
    return ("training rows unshuffled: a batch held mostly one document's neighbouring windows "
            "(--shuffle-rows 0)")


def train_and_load(model_cfg: ModelConfig, train_cfg: TrainConfig, run_dir: str | None = None):
    """Train (quietly) and return ``(model, params, tokenizer, final_metrics)``."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_dir or os.path.join(tmp, "run")
        cfg = train_cfg.replace(run_dir=run_dir, progress=False, resume=False)
        final = train(model_cfg, cfg, auto_vocab=True)
        model, params, tokenizer, _ = load_run(run_dir)
    return model, params, tokenizer, final


def trained_dir(experiment: str, model_cfg: ModelConfig, train_cfg: TrainConfig) -> str:
    """Where ``trained`` keeps the run of this config (``init_from`` can point there)."""
    key = cache_key(model=model_cfg, train=train_cfg)
    return os.path.join(RESULTS, ".cache", experiment, "runs", key)


def trained(experiment: str, model_cfg: ModelConfig, train_cfg: TrainConfig):
    """``train_and_load`` once per (model, training) config: the finished run is kept under
    ``results/.cache/<experiment>/runs/`` so a changed evaluation (another length, sliding
    windows, more held-out text) re-scores it without training again. ``TJAX_FRESH=1``
    retrains. Returns ``(model, params, tokenizer, final_metrics)``."""
    run_dir = trained_dir(experiment, model_cfg, train_cfg)
    final_path = os.path.join(run_dir, "final.json")
    if not FRESH and os.path.exists(final_path):
        model, params, tokenizer, _ = load_run(run_dir)
        with open(final_path) as f:
            return model, params, tokenizer, json.load(f)
    tmp = f"{run_dir}.tmp{os.getpid()}"
    model, params, tokenizer, final = train_and_load(model_cfg, train_cfg, tmp)
    if os.path.exists(run_dir):  # a fresh retrain replaces the old run
        import shutil

        shutil.rmtree(run_dir)
    keep = {k: v for k, v in final.items()
            if isinstance(v, (int, float, str)) or k == "history"}  # the logged loss curve
    with open(os.path.join(tmp, "final.json"), "w") as f:
        json.dump(keep, f, default=float)
    os.replace(tmp, run_dir)
    return model, params, tokenizer, keep


@functools.lru_cache(maxsize=64)
def window_losses(model):
    """A jitted ``(params, inputs, targets) -> per-token loss [B, T]``, one per model (modules
    with equal configs are equal): every seed and scheme of that shape reuses its traces."""

    @jax.jit
    def losses(params, inputs, targets):
        logits = model.apply({"params": params}, inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]

    return losses


def eval_loss(model, params, tokens: np.ndarray, length: int, batch_size: int = 8) -> float:
    """Mean next-token loss (nats) over the stream in non-overlapping windows of ``length``
    tokens: every token scored, the early tokens of each window with little context."""
    return float(np.nanmean(position_losses(model, params, tokens, length, batch_size)))


def position_losses(model, params, tokens: np.ndarray, length: int,
                    batch_size: int = 8) -> np.ndarray:
    """Per-position losses ``[N]`` of the stream (``[i]``: the loss of predicting
    ``tokens[i]``; NaN where no window scores it), with the windows of ``eval_loss``: the
    same positions of every model can then be paired (``stats.block_means``)."""
    starts = list(range(0, len(tokens) - length - 1, length))
    if not starts:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is too short for {length}")
    losses_fn = window_losses(model)
    out = np.full(len(tokens), np.nan)
    for i in range(0, len(starts), batch_size):
        chunk = starts[i : i + batch_size]
        chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shape: one compile
        windows = np.stack([tokens[s : s + length + 1] for s in chunk])
        loss_BT = np.asarray(losses_fn(params, windows[:, :-1], windows[:, 1:]))
        for row in range(min(batch_size, len(starts) - i)):
            out[chunk[row] + 1 : chunk[row] + length + 1] = loss_BT[row]
    return out


def scored_chunks(model, params, tokens: np.ndarray, length: int,
                  chunk: int) -> tuple[float, list[float]]:
    """Mean held-out loss with windows of ``length`` and its means over chunks of ``chunk``
    positions: the same chunks for every model, so runs pair (``experiments.stats``)."""
    from experiments.stats import block_means

    losses = position_losses(model, params, tokens, length)
    return float(np.nanmean(losses)), block_means(losses, chunk).tolist()


def unigram_loss(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab: int) -> float:
    """Cross-entropy of the held-out stream under train-split unigram frequencies (add-one):
    the baseline any language model must beat."""
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_tokens].mean())


def core_count() -> int | None:
    """How many cores this process may run on (None where the platform cannot say)."""
    return len(own_cores()) or None


def _cores_used() -> dict:
    """The cores the runs trained on (the thread count changes float rounding, so the last
    digits of a result depend on it)."""
    cores = core_count()
    return {"cores": cores} if cores else {}


def write_results(name: str, payload: dict, table: str, figure=None,
                  rebuilt: bool = False) -> dict[str, str]:
    """Write ``results/<name>.json``, ``.md`` (the table under the command) and ``.png``, and
    print the table and the paths written. ``rebuilt``: ``payload`` is a results JSON read
    back (a replot), written as it is, without this process's command and machine facts."""
    os.makedirs(RESULTS, exist_ok=True)
    paths = {"json": os.path.join(RESULTS, f"{name}.json"),
             "md": os.path.join(RESULTS, f"{name}.md")}
    from transformers_jax.study.splits import environment

    # time since the process started (a resumed run reads shorter; with several result files
    # per process, each counts everything before it too)
    if not rebuilt:
        payload = {"command": command_line(), **environment(), **_cores_used(),
                   "device": jax.devices()[0].device_kind,
                   "wall_seconds": round(elapsed_s(), 1),
                   "load_average": [round(x, 2) for x in os.getloadavg()], **payload}
    with open(paths["json"], "w") as f:
        json.dump(payload, f, indent=1, default=float)
    with open(paths["md"], "w") as f:
        f.write(f"Command: `{payload['command']}`\n\n{table}\n")
    if figure is not None:
        paths["png"] = os.path.join(RESULTS, f"{name}.png")
        figure.savefig(paths["png"], dpi=110, bbox_inches="tight")
    print(table)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths


def read_results(name: str, error) -> dict:
    """``results/<name>.json`` as written by ``write_results``, for ``--replot``; ``error`` (a
    parser's) names the missing file and how to make it."""
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        error(f"--replot: {path} does not exist; run the experiment first (without --replot)")
    with open(path) as f:
        return json.load(f)


def add_replot_option(parser) -> None:
    parser.add_argument("--replot", action="store_true",
                        help="train nothing: rebuild the tables and plots from the results "
                        "JSON (which keeps the command and timings of the run behind it)")


def replotted(args, parser, name: str, report) -> bool:
    """With ``--replot``: ``report(results/<name>.json, rebuilt=True)`` and True (the caller
    then trains nothing); else False."""
    if not args.replot:
        return False
    report(read_results(name, parser.error), rebuilt=True)
    return True


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(x):
        if isinstance(x, float):
            return "n/a" if math.isnan(x) else f"{x:.3f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if not math.isnan(v)], np.float64)
    if arr.size == 0:
        return float("nan"), float("nan")
    return float(arr.mean()), float(arr.std())


def ngram_baselines(split, tokenizer, eval_tokens: np.ndarray) -> dict[str, float]:
    """Unigram (add-one) and Kneser-Ney 2-5-gram held-out losses (nats/token), fitted on the
    split's training text and scored on ``eval_tokens`` (cached like a run)."""
    from transformers_jax.study.ngram import KneserNey

    vocab = tokenizer.vocab_size
    key = cache_key(data=split.sha256, split=split.seed, unit=split.unit, vocab=vocab,
                    eval=[len(eval_tokens), int(eval_tokens.sum())])

    def compute():
        train_tokens = token_stream(tokenizer, split.train_texts(max_bytes=20_000_000))
        out = {"unigram": unigram_loss(train_tokens, eval_tokens, vocab),
               "train_tokens": int(train_tokens.size)}
        for k in (2, 3, 4, 5):
            out[f"{k}-gram"] = KneserNey(k, vocab).fit(train_tokens).loss(eval_tokens)
        return out

    return cached_run("ngram", key, compute)


def heldout_split(data: str | None, n_eval: int, split_seed: int = 0):
    """``(split, held-out byte tokens [n_eval], baselines)``: the seed-drawn split of ``data``
    (``transformers_jax.study.splits``; train on ``split.train_data``), its held-out stream, and the
    n-gram baselines on that stream. The experiments use TrainConfig's byte tokenizer."""
    from transformers_jax.data.tokenizers import ByteTokenizer
    from transformers_jax.study.splits import make_split

    split = make_split(data, seed=split_seed, heldout_bytes=n_eval)
    tokenizer = ByteTokenizer()
    tokens = token_stream(tokenizer, split.heldout, n_eval)
    return split, tokens, ngram_baselines(split, tokenizer, tokens)


def baselines_line(base: dict) -> str:
    """The baselines as one table note."""
    return ("Baselines on the same held-out tokens (nats/token; fitted on the training split, "
            "Kneser-Ney with n-1 tokens of context): " + ", ".join(
                f"{k} {base[k]:.3f}" for k in ("unigram", "2-gram", "3-gram", "4-gram", "5-gram")
                if k in base) + ".")


# ------------------------------------------------------------------------------ plots


def fit_ylim(ax, values, pad: float = 0.08) -> tuple[float, float]:
    """Y-limits that frame the data (not the baselines): its range plus ``pad`` each side."""
    v = np.asarray([x for x in np.ravel(np.asarray(values, np.float64)) if np.isfinite(x)])
    if v.size == 0:
        return ax.get_ylim()
    lo, hi = float(v.min()), float(v.max())
    margin = pad * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1e-3)
    ax.set_ylim(lo - margin, hi + margin)
    return ax.get_ylim()
