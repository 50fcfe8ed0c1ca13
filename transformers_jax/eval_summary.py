"""``tjax eval``'s answer for a person: a few lines and a table, where ``--json`` (and
``--out FILE``) give every figure. Formatting only: the figures are ``evaluation.evaluate_run``'s
and ``harness.tasks.evaluate_tasks``'s dicts, unchanged."""

from __future__ import annotations

from typing import Any

from transformers_jax.text_table import aligned

JSON_HINT = "(--json prints every figure)"


def _head(result: dict[str, Any]) -> str:
    return f"{result['run']}, step {result['step']} ({result['family']})"


def _read(result: dict[str, Any]) -> str:
    """What was read: ``held-out part of the default corpus``, ``all of my.txt``,
    ``validation split of tfds:lm1b``."""
    split, data = result["split"], result["data"] or "the run's data"
    if split == "held-out":
        return f"held-out part of {data}"
    if split == "all of --data":
        return f"all of {data}"
    return f"{split} split of {data}"


def _batches(n: int, size: int) -> str:
    return f"{n} batch{'es' if n != 1 else ''} of {size}"


def _held_out(result: dict[str, Any]) -> list[str]:
    bits = f"bits_per_{result['unit']}"
    lines = [f"{_head(result)}: {_read(result)}, "
             f"{_batches(result['batches'], result['batch_size'])}, "
             f"{result['tokenizer']} tokenizer",
             f"loss {result['loss']:.4f} nats per token, perplexity "
             f"{result['perplexity']:.4g}, {result[bits]:.4f} "
             f"{bits.replace('_', ' ')} at the run's {result['seq_len']} tokens"]
    rows = []
    for entry in result["by_length"]:
        curve = [y for y in entry.get("loss_by_position", []) if y is not None]
        shape = (f"{curve[0]:.3f} -> {curve[-1]:.3f}" if len(curve) > 1 else "")
        rows.append([str(entry["length"]), f"{entry['loss']:.4f}", f"{entry['perplexity']:.4g}",
                     f"{entry[bits]:.4f}", shape])
    if rows:
        has_curve = any(row[-1] for row in rows)
        header = ["length", "loss", "perplexity", bits.replace("_", " "),
                  "loss at first -> last position"]
        if not has_curve:
            header, rows = header[:-1], [row[:-1] for row in rows]
        lines += ["", *aligned(header, rows)]
    if result.get("plot"):
        lines.append(f"loss by position drawn in {result['plot']}")
    passkey = result.get("passkey")
    if passkey:
        cells = ", ".join(f"{length}: {acc:.2f}"
                          for length, acc in passkey["accuracy_by_length"].items())
        lines.append(f"passkey retrieval ({passkey['digits']} digits, "
                     f"{passkey['trials_per_cell']} keys per length and depth): {cells}")
    return lines


def _classifier(result: dict[str, Any]) -> list[str]:
    return [f"{_head(result)}: {result['objective']} classifier over "
            f"{len(result['labels'])} labels: {_read(result)}, {result['examples']} rows",
            f"loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}"]


def _lm_eval(result: dict[str, Any]) -> list[str]:
    rows = []
    for task, metrics in {**result["results"], **result.get("groups", {})}.items():
        shots = result.get("n_shot", {}).get(task)
        samples = result.get("n_samples", {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append([task, metric if filt == "none" else f"{metric} ({filt})",
                         f"{value:.4f}",
                         f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "",
                         "" if shots is None else str(shots),
                         "" if samples is None else str(samples)])
    head = (f"{_head(result)}: lm-eval {result['lm_eval']}, {result['max_length']} tokens a "
            f"pass, batches of {result['batch_size']}"
            + ("" if result.get("limit") is None else f", limit {result['limit']}"))
    return [head, "", *aligned(["task", "metric", "value", "stderr", "shots", "documents"], rows)]


def summary(result: dict[str, Any]) -> str:
    """The lines ``tjax eval`` prints without ``--json``."""
    if "lm_eval" in result:
        lines = _lm_eval(result)
    elif "objective" in result and "accuracy" in result:
        lines = _classifier(result)
    else:
        lines = _held_out(result)
    lines += [f"note: {note}" for note in result.get("notes", [])]
    return "\n".join([*lines, JSON_HINT])
