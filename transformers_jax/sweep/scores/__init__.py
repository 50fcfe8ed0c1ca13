"""The kinds of score a sweep gives its cells, one entry each (``base.ScoreKind``), in the
order the report lists them. A new kind is a file here and one line below: its metric terms,
the ``[eval]`` table that asks for it, its scorer and how a metric reads its units.

    SCORE_KINDS.get("loss").scored(spec)      # the (term, length) rows a cell is scored at
    parse_term("context:shuffle@50", where)   # ("context:shuffle", Length("50", tokens=50))
"""

from __future__ import annotations

from transformers_jax.registry import Registry
from transformers_jax.sweep.scores.base import TERM, Job, ScoreKind
from transformers_jax.sweep.scores.context import ContextUsage
from transformers_jax.sweep.scores.equal_context import EqualContext
from transformers_jax.sweep.scores.exact import ExactMatch
from transformers_jax.sweep.scores.loss import Loss
from transformers_jax.sweep.scores.passkey import Passkey
from transformers_jax.sweep.scores.sliding import Sliding
from transformers_jax.sweep.terms import Length, SpecError

__all__ = ["SCORE_KINDS", "Job", "ScoreKind", "in_order", "kind_of", "parse_term",
           "check_term"]

SCORE_KINDS: Registry[ScoreKind] = Registry("score kind")
ORDER: list[str] = []  # the report's order: as added


def add(name: str, kind: ScoreKind) -> None:
    kind.name = name
    SCORE_KINDS.add(name, kind)
    ORDER.append(name)


add("loss", Loss())
add("loss_k", EqualContext())
add("sliding", Sliding())
add("passkey", Passkey())
add("context", ContextUsage())
add("exact", ExactMatch())


def in_order() -> list[ScoreKind]:
    return [SCORE_KINDS.get(name) for name in ORDER]


def kind_of(term_kind: str) -> ScoreKind:
    """The entry of a term's kind (``loss``, ``context:shuffle``: ``context``)."""
    return SCORE_KINDS.get(term_kind.partition(":")[0])


def parse_term(part: str, where: str) -> tuple[str, Length]:
    """``(kind, length)`` of one metric term (``loss@4x``, ``context:shuffle@50``)."""
    m = TERM.match(part)
    if not m or m.group(1) not in SCORE_KINDS:
        raise SpecError(f"{where}: {part!r} is not a metric; use "
                        + "; or ".join(k.term_help for k in in_order()))
    name, variant, length = m.groups()
    kind = SCORE_KINDS.get(name)
    return (name if variant is None else f"{name}:{variant}",
            kind.parse_term(variant, length, where))


def check_term(kind: str, length: Length, spec, where: str, text: str) -> None:
    """A term of the metric ``text`` is one ``spec`` scores (``SpecError`` naming the fix)."""
    entry = kind_of(kind)
    if spec.task_sweep and not entry.task:
        raise SpecError(f"{where}: {text!r}: a task sweep ([eval.task]) scores no held-out "
                        "text; compare exact@N or exact@A-B (exact match, the mean over lengths "
                        "A-B)")
    entry.check_term(kind, length, spec, where, text)
