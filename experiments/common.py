"""Shared pieces of the ablation experiments: training runs, held-out evaluation at any length,
and writing results (JSON, a markdown table headed by the exact command, a PNG plot)."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.data.sources import open_documents
from transformers_jax.loop import train
from transformers_jax.runs import load_run

RESULTS = os.environ.get("TJAX_RESULTS_DIR", os.path.join(os.path.dirname(__file__), "results"))


def command_line() -> str:
    """The command that produced a result, as a user would type it."""
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    module = os.path.splitext(os.path.relpath(sys.argv[0]))[0].replace(os.sep, ".")
    return f"python -m {module} {args}".strip()


def train_and_load(model_cfg: ModelConfig, train_cfg: TrainConfig, run_dir: str | None = None):
    """Train (quietly) and return ``(model, params, tokenizer, final_metrics)``."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_dir or os.path.join(tmp, "run")
        cfg = train_cfg.replace(run_dir=run_dir, progress=False, resume=False)
        final = train(model_cfg, cfg, auto_vocab=True)
        model, params, tokenizer, _ = load_run(run_dir)
    return model, params, tokenizer, final


def text_tokens(tokenizer, data: str | None, max_tokens: int, role: str = "eval",
                val_fraction: float = 0.05) -> np.ndarray:
    """One split ("eval": held out; "train") as a token stream (documents joined by eos)."""
    docs = open_documents(data, role, val_fraction=val_fraction)
    parts, total = [], 0
    for i in range(len(docs)):
        ids = tokenizer.encode(docs[i].text)
        parts += [ids, np.array([tokenizer.eos_id], np.int32)]
        total += len(ids) + 1
        if total >= max_tokens:
            break
    return np.concatenate(parts)[:max_tokens].astype(np.int32)


def window_losses(model):
    """A jitted ``(params, inputs, targets) -> per-token loss [B, T]``."""

    @jax.jit
    def losses(params, inputs, targets):
        logits = model.apply({"params": params}, inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]

    return losses


def eval_loss(model, params, tokens: np.ndarray, length: int, stride: int | None = None,
              batch_size: int = 8) -> float:
    """Mean next-token loss (nats) over the stream with windows of ``length`` tokens.

    ``stride=None``: non-overlapping windows, every token scored (early tokens of each window
    have little context). ``stride=S``: windows start every S tokens and only their last S
    tokens are scored, so each scored token has at least ``length - S`` tokens of context
    (sliding-window evaluation, as in the ALiBi paper with S > 1).
    """
    step = stride or length
    starts = list(range(0, len(tokens) - length - 1, step))
    if not starts:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is too short for {length}")
    losses_fn = window_losses(model)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        chunk = starts[i : i + batch_size]
        chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shape: one compile
        windows = np.stack([tokens[s : s + length + 1] for s in chunk])
        loss_BT = np.asarray(losses_fn(params, windows[:, :-1], windows[:, 1:]))
        real = min(batch_size, len(starts) - i)
        for row in range(real):
            scored = loss_BT[row] if stride is None or chunk[row] == 0 else loss_BT[row, -stride:]
            total += float(scored.sum())
            count += scored.size
    return total / count


def unigram_loss(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab: int) -> float:
    """Cross-entropy of the held-out stream under train-split unigram frequencies (add-one):
    the baseline any language model must beat."""
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_tokens].mean())


def write_results(name: str, payload: dict, table: str, figure=None) -> dict[str, str]:
    """Write ``results/<name>.json``, ``.md`` (the table under the command) and ``.png``, and
    print the table and the paths written."""
    os.makedirs(RESULTS, exist_ok=True)
    paths = {"json": os.path.join(RESULTS, f"{name}.json"),
             "md": os.path.join(RESULTS, f"{name}.md")}
    payload = {"command": command_line(), "jax": jax.__version__,
               "device": jax.devices()[0].device_kind, **payload}
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
