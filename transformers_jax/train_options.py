"""The options of ``tjax train`` turned into a ``ModelConfig`` and a ``TrainConfig``: every
field as ``--model.FIELD=VALUE`` / ``--train.FIELD=VALUE``, ``--preset``, ``--config FILE``,
and the model of ``--train.init_from=RUN``. The commands that take a training config (train,
plan, sweep) read it here, so they agree on every rule."""

from __future__ import annotations

import dataclasses

from transformers_jax.config import (
    NAMED_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    check_family,
    from_dict,
)
from transformers_jax.overrides import (
    ALIASES,
    CommandParser,
    Once,
    describe_default,
    field_help,
    read_config_file,
)
from transformers_jax.registry import FAMILIES


def train_parser() -> CommandParser:
    parser = CommandParser(
        "tjax train", "Train a model. Every field of the model and training configs is an "
        "option, --model.FIELD=VALUE or --train.FIELD=VALUE (listed below with its default); "
        "--config FILE.json loads both sections first.", overrides=True, epilog=option_help())
    parser.add_argument("--preset", metavar="NAME", action=Once,
                        help="start from a named model ('tjax presets' lists them); "
                        "the --model.* options apply on top of it")
    return parser


def model_of_run(run_dir: str | None) -> dict | None:
    """The model config saved with a trained or converted run's newest intact checkpoint, the
    one fine-tuning loads (None for no run)."""
    if run_dir is None or run_dir.lower() in ("none", "null"):
        return None
    from transformers_jax.runs.meta import read_run_meta  # orbax: only when asked

    try:
        return read_run_meta(run_dir)["model"]
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--train.init_from={run_dir}: {err}") from None


# Settings of one invocation, never taken from the run a resume continues: how it prints, a
# one-time permission (accept_data_change), this launch's processes (where process 0 listens,
# how many, which one this is).
INVOCATION_FIELDS = ("json", "progress", "profile", "coordinator", "num_processes",
                     "process_id", "accept_data_change", "resume")


def saved_configs(run_dir: str | None) -> dict | None:
    """``{"model": ..., "train": ...}`` saved with ``run_dir``'s newest checkpoint, the run a
    resume continues (None: no run begun there). Read as a file, before JAX starts (a
    multi-host launch initialises ``jax.distributed`` first)."""
    from transformers_jax.runs.layout import newest_meta

    meta = newest_meta(run_dir)
    if meta is None or "model" not in meta:
        return None
    train = {k: v for k, v in (meta.get("train") or {}).items() if k not in INVOCATION_FIELDS}
    return {"model": meta["model"], "train": train}


def build_configs(argv: list[str]) -> tuple[ModelConfig, TrainConfig]:
    """The configs of a ``tjax train`` command line. A ``--run-dir`` that holds a run (and no
    ``--config``) starts from that run's saved settings, the options given on top: a resume
    needs only what changes (``--steps``), and whatever differs is still checked by the loop.
    Otherwise ``--train.init_from=RUN`` gives RUN's model, the ``--model.*`` options on top."""
    args, overrides, config_file = train_parser().parse(argv)
    preset = args.preset
    base = read_config_file(config_file) if config_file else {}
    if preset is not None and base.get("model"):
        raise ConfigError(f"--preset {preset} and a model section in {config_file}: "
                          "give the model one way (drop one of them)")
    resume = overrides.get("train.resume", "true").lower() not in ("false", "0", "no")
    saved = None if config_file or not resume else saved_configs(overrides.get("train.run_dir"))
    if saved is not None:
        base = {"train": saved["train"], **({} if preset is not None else
                                            {"model": saved["model"]})}
    run_model = None if preset is not None or base.get("model") else model_of_run(
        overrides.get("train.init_from", (base.get("train") or {}).get("init_from")))
    model_cfg = (ModelConfig.preset(preset) if preset is not None
                 else from_dict(ModelConfig, run_model or base.get("model", {})))
    train_cfg = from_dict(TrainConfig, base.get("train", {}))
    sections = {"model": {}, "train": {}}
    for key, value in overrides.items():
        section, _, rest = key.partition(".")
        sections[section][rest] = value
    check_family(sections["model"].get("family", model_cfg.family))
    family = FAMILIES.get(sections["model"].get("family", model_cfg.family))
    # The family's own mask (bert: bidirectional) unless one is given; a preset's mask (e.g.
    # Mistral's sliding window) stays unless the family changes.
    mask_given = "mask" in sections["model"] or "mask" in base.get("model", {})
    if not mask_given and (preset is None and run_model is None and saved is None
                           or "family" in sections["model"]):
        sections["model"]["mask"] = family.default_mask
    model_cfg = apply_overrides(model_cfg, sections["model"], "model.")
    train_cfg = apply_overrides(train_cfg, sections["train"], "train.")
    return model_cfg, train_cfg


def option_help() -> str:
    """Every config option with its default and its help line, and each switch's entries with
    the settings they take."""
    lines = []
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        lines += ["", f"{section} options (--{section}.FIELD=VALUE, default shown):"]
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):  # a group of settings (train.lora): each one
                own = field_help(type(default))
                lines += [f"  {f'--{section}.{f.name}.{g.name}={describe_default(g.default)}':<34}"
                          f" {own.get(g.name, '')}".rstrip()
                          for g in dataclasses.fields(default) if g.init]
                continue
            option = f"--{section}.{f.name}={describe_default(default)}"
            text = helps.get(f.name, "")
            if f.name in NAMED_FIELDS:  # the names as registered, never a stale list
                text += f" (one of: {', '.join(NAMED_FIELDS[f.name].selectable())})"
            lines.append(f"  {option:<34} {text}".rstrip())
            registry = f.metadata.get("registry")
            if registry is None:
                continue
            for name, entry in registry.items():  # a switch: its entries and their settings
                own = " ".join(f"--{section}.{f.name}.{g.name}={describe_default(g.default)}"
                               for g in dataclasses.fields(entry) if g.init and g.name != "name")
                lines.append(f"      {f.name}={name}" + (f": {own}" if own else ""))
    lines += ["", "aliases: " + ", ".join(f"{a} ({t})" for a, t in ALIASES.items())
              + ", --json, --no-progress, --config FILE.json"]
    return "\n".join(lines)


def follows_tokenizer(model_cfg: ModelConfig) -> bool:
    """Whether the vocabulary is left to the tokenizer (``train(auto_vocab=...)``): unless it
    was given explicitly, as a published preset's is."""
    return model_cfg.vocab_size == ModelConfig().vocab_size
