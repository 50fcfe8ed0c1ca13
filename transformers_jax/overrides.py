"""Command-line overrides: ``--model.FIELD=VALUE`` / ``--train.FIELD VALUE`` (and the short
aliases) parsed into ``{"model.FIELD": "VALUE", ...}`` for ``config.apply_overrides``.

Shared by ``tjax train`` (``cli.py``) and ``tjax bench`` (``bench.py``), so neither imports the
other.
"""

from __future__ import annotations

from transformers_jax.config import ConfigError

ALIASES = {
    "--data": "train.data",
    "--steps": "train.steps",
    "--run-dir": "train.run_dir",
    "--seed": "train.seed",
    "--family": "model.family",
    "--task": "train.task",
    "--tokenizer": "train.tokenizer",
}
FLAGS = {"--json": "train.json", "--no-progress": ("train.progress", "false")}
PRESET_OPTION = "--preset"  # a named model (presets.py), applied before the --model.* overrides


def split_preset(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--preset NAME`` / ``--preset=NAME`` out of ``argv``: (NAME or None, the rest)."""
    name, rest, i = None, [], 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        if key != PRESET_OPTION:
            rest.append(argv[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"option {PRESET_OPTION} needs a name ('tjax presets' "
                                  "lists them)")
            value = argv[i + 1]
            i += 1
        if name is not None and value != name:
            raise ConfigError(f"{PRESET_OPTION} given twice ({name!r} and {value!r}); pick one")
        name = value
        i += 1
    return name, rest


def parse_overrides(argv: list[str]) -> tuple[dict[str, str], str | None]:
    """Split ``--section.field=value`` / ``--section.field value`` into a dict."""
    overrides: dict[str, str] = {}
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --model.d_model=64")
        key, eq, value = arg.partition("=")
        if key in FLAGS and not eq:
            target = FLAGS[key]
            name, value = target if isinstance(target, tuple) else (target, "true")
            overrides[name] = value
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"option {key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "--config":
            config_file = value
            continue
        name = ALIASES.get(key, key[2:])
        if not name.startswith(("model.", "train.")):
            raise ConfigError(
                f"unknown option {key}; use --model.FIELD or --train.FIELD (or one of "
                f"{', '.join([*ALIASES, *FLAGS, '--config', PRESET_OPTION])})"
            )
        overrides[name] = value
    return overrides, config_file
