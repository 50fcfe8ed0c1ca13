"""Mixtures of sources: ``--data "0.7*hf:NAME,0.3*./my_text/"``.

Every part is ``WEIGHT*SPEC`` (any source spec but another mixture); the weights need not sum
to 1 and are reported normalised. The pipeline interleaves the parts' documents (pieces,
records) by a fixed weighted schedule (Grain's ``IterDataset.mix``), each part shuffled by the
run's seed and repeated on its own, so the mixture is the same for a seed and its state (the
schedule's position and each part's) resumes exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re

from transformers_jax.data.records import DataSpecError

_PART = re.compile(r"^\s*([^*/,]*?)\s*\*\s*(\S.*?)\s*$")
_FORM = "WEIGHT*SPEC,WEIGHT*SPEC, e.g. '0.7*hf:wikitext:wikitext-2-raw-v1,0.3*./my_text/'"


@dataclasses.dataclass(frozen=True)
class Part:
    weight: float  # normalised: the weights of a mixture sum to 1
    spec: str


def is_mixture(spec: str | None) -> bool:
    """Whether ``spec`` is a mixture: its first part is ``WEIGHT*...`` with a weight that
    reads as a number (a glob such as ``corpus/*.txt`` is not)."""
    if not spec:
        return False
    match = _PART.match(spec.split(",")[0])
    if match is None:
        return False
    try:
        float(match.group(1))
    except ValueError:
        return "," in spec  # "x*a,0.3*b": meant as a mixture; parse_mixture says what is wrong
    return True


def parse_mixture(spec: str) -> tuple[Part, ...]:
    """The parts of a mixture spec with normalised weights, or a ``DataSpecError`` naming the
    part at fault and the form."""
    parts, raw = [], [p for p in spec.split(",")]
    for text in raw:
        match = _PART.match(text)
        if match is None:
            raise DataSpecError(
                f"--data {spec!r}: the part {text.strip()!r} has no weight; write {_FORM}"
            )
        weight_text, source = match.groups()
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataSpecError(
                f"--data {spec!r}: the weight {weight_text!r} of "
                f"{source!r} is not a number; write {_FORM}"
            ) from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataSpecError(
                f"--data {spec!r}: the weight {weight_text!r} of {source!r} "
                "must be a positive number"
            )
        if is_mixture(source):
            raise DataSpecError(
                f"--data {spec!r}: {source!r} is itself a mixture; list every "
                "source once at the top level"
            )
        parts.append((weight, source))
    if len(parts) < 2:
        raise DataSpecError(
            f"--data {spec!r}: a mixture needs two sources or more; for one, drop the weight"
        )
    total = sum(w for w, _ in parts)
    return tuple(Part(w / total, s) for w, s in parts)


def describe(parts: tuple[Part, ...]) -> str:
    """``"a mixture of 70% A, 30% B (by documents)"``: how the run README reports it."""
    shares = ", ".join(f"{p.weight:.1%} {p.spec}".replace(".0%", "%") for p in parts)
    return f"a mixture by documents of {shares}"
