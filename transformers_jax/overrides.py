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
                f"{', '.join([*ALIASES, *FLAGS, '--config'])})"
            )
        overrides[name] = value
    return overrides, config_file
