"""The vocabulary a sweep's spec is written in, below the spec and the score kinds that both
read it: the error a bad spec raises, evaluation lengths, task-length ranges and the checks of
single values. No JAX."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from transformers_jax.config import ConfigError
from transformers_jax.overrides import closest


class SpecError(ConfigError):
    """A spec that cannot run: the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class Length:
    """An evaluation length: ``times`` x the cell's seq_len, or ``tokens``."""

    text: str
    times: float | None = None
    tokens: int | None = None

    def resolve(self, seq_len: int) -> int:
        if self.tokens is not None:
            return self.tokens
        n = self.times * seq_len
        if n != int(n) or n < 2:
            raise SpecError(f"eval length {self.text} of seq_len {seq_len} is {n} tokens: "
                            "choose a multiple that gives a whole number of at least 2")
        return int(n)


def parse_length(text: Any, where: str) -> Length:
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 2:
            raise SpecError(f"{where} = {text}: a length is at least 2 tokens")
        return Length(str(text), tokens=text)
    if isinstance(text, str) and re.fullmatch(r"\d+(\.\d+)?x", text):
        times = float(text[:-1])
        if times <= 0:
            raise SpecError(f"{where} = {text!r}: the multiple must be positive")
        return Length(text, times=times)
    raise SpecError(f"{where} = {text!r}: give tokens (256) or a multiple of the cell's "
                    "seq_len as a string (\"2x\", \"0.25x\")")


def length_value(text: str) -> Any:
    """A length as a metric writes it (``4x``, ``256``) as a spec's table gives it."""
    return text if text.endswith("x") else int(text)


def task_range(text: str) -> tuple[int, int]:
    """``"21-40"`` -> (21, 40), ``"7"`` -> (7, 7): task lengths, inclusive."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def unknown_keys(keys, known: set[str], where: str) -> None:
    for key in keys:
        if key not in known:
            near = closest(key, known)
            hint = f"did you mean {near!r}? " if near else ""
            raise SpecError(f"{where}: unknown key {key!r}; {hint}valid keys: "
                            f"{', '.join(sorted(known))}")


def positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{where} = {value!r}: must be a positive integer")
    return value


def seed_value(value: Any, where: str, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{where} = {value!r}: a non-negative integer{why}")
    return value


def distinct_list(value: Any, where: str, item_ok, item: str) -> list:
    if not isinstance(value, list) or not value or not all(item_ok(v) for v in value):
        raise SpecError(f"{where} = {value!r}: a non-empty list of {item}")
    if len(set(value)) != len(value):
        raise SpecError(f"{where} = {value!r}: a value is listed twice")
    return value
