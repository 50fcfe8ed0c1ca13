"""``RUN_DIR/README.md``: a run directory that explains itself.

Written by ``train.loop.train`` when a run ends (process 0 only) and rewritten by each resumed
invocation that trains: the model (preset, family, switches, parameter count; a classifier's
objective and labels), the data, the steps, the final metrics, the segments (one per invocation
that trained: its steps, schedule and command), the command that reproduces it (plus the full
configs and the segments in ``tjax_config.json`` for ``--config``), and the commands that use
it: sampling, filling masks, evaluation and export where the model allows each (a classifier is
evaluated only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
from collections.abc import Sequence
from typing import Any

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.learning.objectives import run_objective
from transformers_jax.models import family_of
from transformers_jax.nn.kvcache import check_decoding
from transformers_jax.runs.layout import CONFIG_FILE, LABELS_FILE, README_FILE

__all__ = ["CONFIG_FILE", "README_FILE", "run_readme", "write_run_readme"]


def _changes(base: dict, now: dict, prefix: str = "") -> list[str]:
    """``["position=alibi", "d_model=256"]``: the fields of ``now`` that differ from ``base``
    (a switch whose entry changed is given by its name alone)."""
    out = []
    for key, value in now.items():
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            if value.get("name") != old.get("name"):
                out.append(f"{prefix}{key}={value.get('name')}")
            else:
                out += _changes(old, value, f"{prefix}{key}.")
        elif value != old:
            out.append(f"{prefix}{key}={value}")
    return out


def _model_lines(model_cfg: ModelConfig, preset: str | None, n_params: int) -> list[str]:
    c = model_cfg
    layers = (f"{c.n_layers} encoder + {c.decoder_layers} decoder layers"
              if family_of(c).cross_attention else f"{c.n_layers} layers")
    heads = f"{c.n_heads} heads" + (f" ({c.kv_heads} key/value)" if c.kv_heads != c.n_heads
                                    else "")
    lines = []
    if preset is not None:
        changed = _changes(ModelConfig.preset(preset).to_dict(), c.to_dict())
        lines.append(f"- preset: `{preset}`" + (
            "; changed: " + "; ".join(f"`{d}`" for d in changed) if changed else " (unchanged)"))
    lines += [
        f"- family `{c.family}`: {layers}, d_model {c.d_model}, {heads} of {c.dims_per_head}, "
        f"MLP {c.ff_dim} ({c.mlp}), vocabulary {c.vocab_size}",
        f"- attention `{c.attention}`, mask `{c.mask}`, position `{c.position}`, norm "
        f"`{c.norm}` ({c.norm_position}), biases {'yes' if c.use_bias else 'no'}, tied "
        f"embeddings {'yes' if c.tie_embeddings else 'no'}, dtype {c.dtype}",
        f"- parameters: {n_params:,}",
    ]
    return lines


def _metric(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def _schedule(total: int, warmup: int, steps: int) -> str:
    return (f"warm-up {warmup}, cosine over {total} steps"
            + (f", then flat to step {steps}" if steps > total else ""))


def _segment_lines(segments: list[dict]) -> list[str]:
    """A table of the run's segments, one per invocation that trained."""
    lines = ["## Segments", "", "One row per invocation that trained this run (also in "
             f"`{CONFIG_FILE}`):", "", "| steps | asked | learning-rate schedule | command |",
             "|---|---|---|---|"]
    for seg in segments:
        command = (f"`{seg['command']}`".replace("|", "\\|") if seg.get("command")
                   else "(not recorded)")
        lines.append(f"| {seg['start']}-{seg['end']} | {seg['steps']} | "
                     f"{_schedule(seg['schedule_steps'], seg['warmup_steps'], seg['steps'])} | "
                     f"{command} |")
    return [*lines, ""]


def _can_sample(model_cfg: ModelConfig) -> bool:
    """What ``tjax sample`` checks first: a family that generates, with a mask, positions and
    kernel that decode with a KV cache."""
    if not family_of(model_cfg).generates:
        return False
    try:
        check_decoding(model_cfg)
    except ConfigError:
        return False
    return True


def _prompt_for(cfg: TrainConfig) -> str:
    """A prompt the run was trained to answer: an example of its task, else text."""
    if not cfg.task:
        return "Once upon a time"
    import numpy as np

    from transformers_jax.data.synthetic import get_task

    return get_task(cfg.task).make(np.random.default_rng(0), 3)[0]


def _use_lines(run_dir: str, model_cfg: ModelConfig, classifier: bool,
               cfg: TrainConfig) -> list[str]:
    """The commands that use the run: those its model can take."""
    family, quoted = family_of(model_cfg), shlex.quote(run_dir)
    if classifier:  # class logits: no tokens to sample or fill, no Hugging Face mapping
        return [f"tjax eval --run {quoted}   # held-out loss and accuracy on its labelled data"]
    lines = []
    if _can_sample(model_cfg):
        # a position table caps the tokens: the default then fills what is left (with a note)
        bounded = model_cfg.position.max_length(model_cfg) is not None
        lines.append(f"tjax sample --run {quoted} --prompt {shlex.quote(_prompt_for(cfg))}"
                     + ("" if bounded else " --max-new-tokens 100"))
    if family.fills_masks:
        lines.append(f"tjax fill-mask --run {quoted} --text \"The [MASK] is blue.\"")
    return [*lines, f"tjax eval --run {quoted}"]


def _export_lines(run_dir: str, hf_class: str | None) -> list[str]:
    """The export command, for a model a Hugging Face architecture expresses exactly
    (``hf_class``, the converter's answer: ``convert.export_class``); none otherwise."""
    if hf_class is None:
        return []
    out = shlex.quote(run_dir.rstrip("/") + "-hf")
    return [f"tjax convert --to-hf {out} --run {shlex.quote(run_dir)}   # a Hugging Face "
            f"{hf_class} (transformers loads it)"]


def run_readme(run_dir: str, model_cfg: ModelConfig, cfg: TrainConfig, final: dict, *,
               data_description: str, tokenizer: str, preset: str | None = None,
               command: str | None = None, version: str = "",
               segments: list[dict] | None = None,
               labels: Sequence[str] | None = None,
               lineage: Sequence[str] | None = None,
               hf_class: str | None = None) -> str:
    """The markdown text of ``RUN_DIR/README.md``; ``segments`` (``train.loop``) are listed
    when there are several; ``labels``: a classifier's class names (id = position);
    ``lineage``: where a run made from others came from (``tjax merge``), one item each; such
    a run trained no step itself, so it has no figures and its command is not a resume;
    ``hf_class``: the Hugging Face class an export would write (``convert.export_class``),
    when one expresses the model: the export command is suggested with it."""
    objective = run_objective(model_cfg, cfg.objective)
    classifier = objective.head is not None
    status = (f"stopped by {final['stopped_by']} at step {final['steps']} of {cfg.steps} (run "
              "the same command again to continue)" if final.get("stopped_by")
              else f"{final['steps']} of {cfg.steps} steps")
    lines = [
        f"# {preset or model_cfg.family} {'classifier ' if classifier else ''}run",
        "",
        (f"Written by `tjax merge` with transformers-jax {version} "
         f"({time.strftime('%Y-%m-%d %H:%M:%S %Z')}) at step {final['steps']}."
         if lineage else
         f"Trained with transformers-jax {version} ({time.strftime('%Y-%m-%d %H:%M:%S %Z')}): "
         f"{status}."),
        "",
        *(["## Lineage", "", *(f"- {item}" for item in lineage), ""] if lineage else []),
        "## Model",
        "",
        *_model_lines(model_cfg, preset, final["params"]),
        *([f"- objective `{objective.name}`: a {objective.head} classification head on the "
           "encoder"] if classifier else []),
        "",
        "## Data",
        "",
        f"- {data_description}",
        *([f"- labels (id = position, in `{LABELS_FILE}`): "
           + ", ".join(f"`{name}`" for name in labels)] if labels else []),
        f"- tokenizer: {tokenizer}; sequences of {cfg.seq_len} tokens, batches of "
        f"{cfg.batch_size}" + (f", task `{cfg.task}`" if cfg.task else ""),
        "",
        "## Training",
        "",
        f"- steps {final['steps']} (asked {cfg.steps}), AdamW learning rate {cfg.learning_rate} "
        f"decaying to x{cfg.min_lr_ratio} ({_schedule(cfg.schedule_total, cfg.warmup, cfg.steps)}"
        f"), weight decay {cfg.weight_decay}, seed {cfg.seed}, strategy {cfg.strategy}",
        *([f"- trained as one of {final['seeds_together']} seeds in one program "
           "(`train.seeds`); tokens/s and MFU are this seed's share"]
          if final.get("seeds_together") else []),
        "",
        *([] if lineage else [  # no step trained here: no figures
            "| train loss | eval loss | eval accuracy | tokens/s | MFU |",
            "|---|---|---|---|---|",
            f"| {_metric(final.get('train_loss'))} | {_metric(final.get('eval_loss'))} | "
            f"{_metric(final.get('eval_accuracy'))} | {final.get('tokens_per_s', 0):,.0f} | "
            f"{100 * final.get('mfu', 0):.2f}% |",
            "",
            "Per-step metrics: `metrics.jsonl` (and `tensorboard/` when enabled).",
            ""]),
        *(_segment_lines(segments) if segments and len(segments) > 1 else []),
        "## Reproduce",
        "",
    ]
    if command and lineage:
        lines += ["The command that wrote this run:", "", "```", command, "```", ""]
    elif command:
        which = "of its latest segment" if segments and len(segments) > 1 else "that wrote this run"
        lines += [f"The command {which} (run it again to resume; with another "
                  "`--run-dir` to train afresh):", "", "```", command, "```", ""]
    lines += [f"Every setting, independent of defaults that may change: `{CONFIG_FILE}` in this "
              "directory (`--run-dir` is in it: edit it to train afresh elsewhere):", "", "```",
              f"tjax train --config {shlex.quote(os.path.join(run_dir, CONFIG_FILE))}", "```", "",
              "## Use it", "", "```", *_use_lines(run_dir, model_cfg, classifier, cfg),
              *_export_lines(run_dir, None if classifier else hf_class), "```", ""]
    return "\n".join(lines)


def write_run_readme(run_dir: str, model_cfg: ModelConfig, cfg: TrainConfig, final: dict,
                     **kwargs: Any) -> str:
    """Write ``README.md`` and ``tjax_config.json`` into ``run_dir``; returns the README path."""
    with open(os.path.join(run_dir, CONFIG_FILE), "w") as f:
        json.dump({"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(cfg),
                   "segments": kwargs.get("segments") or []}, f, indent=2)
        f.write("\n")
    path = os.path.join(run_dir, README_FILE)
    with open(path, "w") as f:
        f.write(run_readme(run_dir, model_cfg, cfg, final, **kwargs))
    return path
