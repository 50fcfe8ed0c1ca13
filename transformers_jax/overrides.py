"""The command-line grammar every ``tjax`` subcommand shares.

``CommandParser``: argparse with each option's default in its help line, ``-h``/``--help``,
and an unknown option answered with the closest valid one. Subcommands that build a model
(``train``, ``bench``) also take config overrides, ``--model.FIELD=VALUE`` /
``--train.FIELD VALUE`` and short aliases, parsed by ``parse_overrides`` into
``{"model.FIELD": "VALUE", ...}`` for ``config.apply_overrides``. ``field_help`` gives each
config field its help line, from the comment beside the field in ``config.py``.

Why not a library that builds the CLI from the dataclasses (tyro, draccus, jsonargparse)?
Tried on these configs (2026-11-30: tyro 1.0.17, draccus 0.11.6, jsonargparse 4.53.0): none
takes a registry switch the way this project spells it (``--model.position=t5
--model.position.num_buckets=16``, entries loaded lazily from the registries). tyro parses
the plain fields but refuses the switch (it would need a Union of every entry, spelled as a
subcommand ``model.position:t5``); draccus reads the switch as a string and rejects its
settings; jsonargparse refuses the switch's default. Each would change every documented
command and add an import (0.1-0.3 s) before the first error message, so the grammar stays
here: one small parser on argparse, shared by every subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import io
import json
import os
import textwrap
import tokenize
from typing import Any

from transformers_jax.config import ConfigError

ALIASES = {
    "--data": "train.data",
    "--data.field": "train.text_key",
    "--data.download": "train.data_download",
    "--steps": "train.steps",
    "--run-dir": "train.run_dir",
    "--seed": "train.seed",
    "--family": "model.family",
    "--task": "train.task",
    "--tokenizer": "train.tokenizer",
    "--profile": "train.profile",
}
FLAGS = {"--json": "train.json", "--no-progress": ("train.progress", "false")}
SECTIONS = ("model", "train")


def closest(word: str, choices) -> str | None:
    """The valid name nearest to a typo, if any is near enough."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def override_names() -> list[str]:
    """Every ``--model.FIELD``/``--train.FIELD`` option, the aliases and ``--config``."""
    from transformers_jax.config import ModelConfig, TrainConfig

    names = [f"--{section}.{f.name}" for section, cls in (("model", ModelConfig),
                                                           ("train", TrainConfig))
             for f in dataclasses.fields(cls) if f.init]
    return [*names, *ALIASES, *FLAGS, "--config"]


def parse_overrides(argv: list[str], options: list[str] = ()) -> tuple[dict[str, str], str | None]:
    """Split ``--section.field=value`` / ``--section.field value`` into a dict.

    ``options``: the subcommand's own option names, offered beside the overrides when an
    argument is unknown.
    """
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
        if not name.startswith(tuple(f"{s}." for s in SECTIONS)):
            raise unknown_option(key, options)
        overrides[name] = value
    return overrides, config_file


def unknown_option(key: str, options: list[str] = ()) -> ConfigError:
    """The error for an option that is neither the command's own nor a config override."""
    near = closest(key, [*options, *override_names()])
    hint = f"did you mean {near}? " if near else ""
    return ConfigError(f"unknown option {key}; {hint}use --model.FIELD or --train.FIELD (or one "
                       f"of {', '.join([*options, *ALIASES, *FLAGS, '--config'])})")


# Keys of a saved run config (RUN_DIR/tjax_config.json) that record the run rather than set it.
CONFIG_RECORD_KEYS = ("preset", "segments")


def read_config_file(path: str) -> dict[str, dict]:
    """The ``--config FILE.json`` sections, ``{"model": {...}, "train": {...}}`` (either may be
    missing). A missing file, bad JSON or an unknown section is a ``ConfigError`` naming the
    file and the fix, so a typo (``"trian"``) never leaves the defaults silently in place."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config {path}: not valid JSON at line {err.lineno}, column "
                          f"{err.colno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a JSON object with \"model\" and/or "
                          f"\"train\" sections, got {type(data).__name__}")
    for key, value in data.items():
        if key in CONFIG_RECORD_KEYS:
            continue
        if key not in SECTIONS:
            near = closest(key, SECTIONS)
            hint = f"did you mean {near!r}? " if near else ""
            raise ConfigError(f"--config {path}: unknown section {key!r}; {hint}the sections "
                              f"are {', '.join(map(repr, SECTIONS))}")
        if not isinstance(value, dict):
            raise ConfigError(f"--config {path}: section {key!r} must be a JSON object of "
                              f"fields, got {type(value).__name__}")
    return {section: data.get(section) or {} for section in SECTIONS}


def int_list(text: str) -> list[int]:
    """An argparse type: positive whole numbers separated by commas (``128,256``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 128,256") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers like 128,256")
    return values


class Once(argparse.Action):
    """An option that may be given once (or repeated with the same value)."""

    def __call__(self, parser, namespace, value, option_string=None):
        previous = getattr(namespace, self.dest)
        if previous is not None and previous != value:
            parser.error(f"{option_string} given twice ({previous!r} and {value!r}); pick one")
        setattr(namespace, self.dest, value)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, unless it has none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False
                or default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """The parser of one ``tjax`` subcommand (see the module docstring).

    ``overrides=True``: arguments that are not this command's own options are config
    overrides; ``parse`` returns them with the parsed options.
    """

    def __init__(self, prog: str, description: str, *, overrides: bool = False,
                 epilog: str | None = None) -> None:
        usage = (f"{prog} [options] [--model.FIELD=VALUE ...] [--train.FIELD=VALUE ...] "
                 "[--config FILE.json]") if overrides else None
        super().__init__(prog=prog, description=textwrap.fill(description, 96), epilog=epilog,
                         usage=usage, formatter_class=_HelpFormatter, allow_abbrev=False)
        self.takes_overrides = overrides

    def options(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings
                if s.startswith("--") and s != "--help"]

    def parse(self, argv: list[str]) -> tuple[argparse.Namespace, dict[str, str], str | None]:
        """``(options, overrides, --config file)``. Bad options exit 2 with a message (argparse);
        bad overrides raise ``ConfigError`` (``tjax`` prints it and exits 2)."""
        # a misspelt option first: argparse would complain of a missing required one
        known = {*self.options(), "--help"}
        if self.takes_overrides:
            known |= {*ALIASES, *FLAGS, "--config"}
        unknown = [a for a in argv if a.startswith("--") and a.partition("=")[0] not in known
                   and not (self.takes_overrides and a.startswith(("--model.", "--train.")))]
        if unknown and self.takes_overrides:
            raise unknown_option(unknown[0].partition("=")[0], self.options())
        if unknown:
            self.error("unrecognized arguments: " + " ".join(unknown))
        if not self.takes_overrides:
            return self.parse_args(argv), {}, None
        args, rest = self.parse_known_args(argv)
        overrides, config_file = parse_overrides(rest, self.options())  # ConfigError: exit 2
        return args, overrides, config_file

    def error(self, message: str):
        """One line and exit 2 (argparse prints its whole usage first, which buries the
        error), with the closest valid option for an unknown one."""
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            unknown = [a.partition("=")[0] for a in message[len(prefix):].split()
                       if a.startswith("-")]
            valid = self.options() + (override_names() if self.takes_overrides else [])
            hints = [f"{u} (did you mean {near}?)" for u in unknown
                     if (near := closest(u, valid))]
            if hints:
                message = f"unknown option {', '.join(hints)}; {self.prog} --help lists them"
        if "--help" not in message:
            message += f" ({self.prog} --help lists the options)"
        self.exit(2, f"{self.prog}: error: {message}\n")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``{field: help}`` from the comment beside each field of the dataclass ``cls``
    (``d_ff: int | None = None  # None: 4 * d_model``). Empty when the source is not
    available (a frozen install)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    line_field: dict[int, str] = {}
    for line_no, line in enumerate(source.splitlines(), 1):
        head = line.strip().split(":", 1)[0]
        if line.startswith("    ") and not line.startswith("     ") and head in names:
            line_field[line_no] = head
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] in line_field:
            found[line_field[tok.start[0]]] = tok.string.lstrip("#").strip()
    return found


def print_json(result: dict, path: str | None = None, indent: int | None = None) -> None:
    """A command's result: printed as JSON (one line unless ``indent``) and, given a path,
    written there too (its folder made first)."""
    print(json.dumps(result, indent=indent, default=float))
    if path:
        write_json(result, path, indent)


def write_json(result: dict, path: str, indent: int | None = None) -> None:
    """``result`` as JSON in the file ``path`` (its folder made first)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(result, indent=indent, default=float) + "\n")


def describe_default(value: Any) -> str:
    """A default as it is typed on the command line."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "name", value))
