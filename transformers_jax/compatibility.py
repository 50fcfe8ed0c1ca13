"""Which switch combinations work, asked of the switches themselves.

For every positional scheme x attention kernel x mask (the registries' entries, with their default
settings; a window of 16 for ``sliding_window``) and every use (training, KV-cache decoding,
context parallelism by all-gather, ring or zigzag ring), ``support`` answers with the refusal the
library itself would give, or None: the table is what the config checks, the decoding check and the
context-parallel check say, so it cannot drift from them. ``docs_table`` and ``readme_table``
render it; ``tests/test_compatibility.py`` keeps the documents equal to it and checks every
supported cell against the reference kernel.

A mask is tried with the first family that accepts it with the oracle kernel, families that
continue a prompt first (a decoder-only LM), so a kernel is judged on the model that decodes
with it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from transformers_jax.config import CONTEXT_ATTENTION, ConfigError, ModelConfig
from transformers_jax.models import family_of
from transformers_jax.nn.kvcache import check_decoding
from transformers_jax.parallel.context import method_refusal
from transformers_jax.registry import ATTENTION, FAMILIES, MASKS, POSITIONS

USES = ("train", "decode", *(f"context:{m}" for m in CONTEXT_ATTENTION))
MASK_SETTINGS = {"window": 16}  # a setting a mask needs to be built at all
BASE = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_len=64)


class Cell(NamedTuple):
    """One combination: its model config (None when no family accepts the mask) and, per use,
    None (supported), the refusal's message, or ``"n/a"`` (the use does not apply: decoding
    an encoder)."""

    config: ModelConfig | None
    refusals: dict[str, str | None]

    def ok(self, use: str) -> bool:
        return self.refusals[use] is None


def mask_switch(name: str) -> dict:
    """``name`` with the settings it needs (a window) and no others."""
    fields = {f.name for f in dataclasses.fields(MASKS.get(name))}
    return {"name": name, **{k: v for k, v in MASK_SETTINGS.items() if k in fields}}


@functools.cache
def family_for(mask: str, position: str) -> str | None:
    """The first family that accepts ``mask`` and ``position`` with the reference kernel,
    decoder-only LMs first."""
    oracle = next(n for n in ATTENTION.names() if ATTENTION.get(n).oracle)
    first = sorted(
        FAMILIES.names(),
        key=lambda f: (not FAMILIES.get(f).continues_prompt, not FAMILIES.get(f).generates),
    )
    for family in first:
        try:
            BASE.replace(family=family, mask=mask_switch(mask), position=position, attention=oracle)
            return family
        except ConfigError:
            continue
    return None


@functools.cache
def support(position: str, attention: str, mask: str) -> Cell:
    family = family_for(mask, position)
    if family is None:
        return Cell(None, dict.fromkeys(USES, f"no family takes mask={mask} with {position}"))
    try:
        config = BASE.replace(
            family=family, mask=mask_switch(mask), position=position, attention=attention
        )
    except ConfigError as e:
        return Cell(None, dict.fromkeys(USES, str(e)))
    refusals: dict[str, str | None] = {"train": None}
    if not family_of(config).generates:
        refusals["decode"] = "n/a"
    else:
        try:
            check_decoding(config)
            refusals["decode"] = None
        except ConfigError as e:
            refusals["decode"] = str(e)
    for method in CONTEXT_ATTENTION:
        refusals[f"context:{method}"] = method_refusal(config.attention, method)
    return Cell(config, refusals)


def bias_only_on(position: str, attention: str, mask: str) -> tuple[str, ...] | None:
    """The platforms a kernel adds this scheme's bias on, when not all it runs on."""
    cell = support(position, attention, mask)
    impl = ATTENTION.get(attention)
    if cell.config is None or impl.bias_backends is None:
        return None
    if cell.config.position.bias(cell.config, bidirectional=not cell.config.mask.causal) is None:
        return None
    return impl.bias_backends


LETTERS = {"train": "T", "decode": "D", "context:ring": "R", "context:all_gather": "G",
           "context:ring_zigzag": "Z"}


def cell_text(position: str, attention: str, mask: str) -> str:
    cell = support(position, attention, mask)
    if not cell.ok("train"):
        return "no"
    text = (
        " ".join(
            LETTERS[u] if cell.ok(u) else ("" if cell.refusals[u] == "n/a" else "-") for u in USES
        )
        .replace("  ", " ")
        .strip()
    )
    only = bias_only_on(position, attention, mask)
    return text + (f" ({'/'.join(only)} only)" if only else "")


def docs_table() -> str:
    """Every combination, a table per mask: schemes down, kernels across; then each distinct
    refusal with the combinations it answers."""
    kernels = ATTENTION.names()
    out = []
    for mask in MASKS.names():
        family = family_for(mask, POSITIONS.names()[0])
        out += [
            f"**mask={mask}** ({family})",
            "",
            "| position | " + " | ".join(f"`{k}`" for k in kernels) + " |",
            "|---|" + "---|" * len(kernels),
        ]
        for position in POSITIONS.names():
            out.append(
                f"| `{position}` | "
                + " | ".join(cell_text(position, k, mask) for k in kernels)
                + " |"
            )
        out.append("")
    reasons: dict[str, list[str]] = {}
    for mask in MASKS.names():
        for position in POSITIONS.names():
            for kernel in kernels:
                for use, why in support(position, kernel, mask).refusals.items():
                    if why not in (None, "n/a"):
                        reasons.setdefault(why, []).append(f"{use} {position}/{kernel}/{mask}")
    out += ["Refusals (the message the library gives, and the combinations that get it):", ""]
    for why, where in reasons.items():
        uses = sorted({w.split()[0] for w in where})
        out.append(f"- {', '.join(uses)}, {len(where)} combinations: {why}")
    return "\n".join(out) + "\n"


def readme_table() -> str:
    """One row per kernel: where it runs and what it supports (the docs table has it all)."""
    rows = [
        "| kernel | runs on | masks | biases | soft-cap | KV-cache decoding | context parallel |",
        "|---|---|---|---|---|---|---|",
    ]
    for kernel in ATTENTION.names():
        impl = ATTENTION.get(kernel)
        rope = support("rope", kernel, "causal")
        masks = [m for m in MASKS.names() if support("rope", kernel, m).ok("train")]
        biased = [p for p in POSITIONS.names() if _has_bias(support(p, kernel, "causal"))]
        bias = "yes" if impl.bias_backends is None else f"on {'/'.join(impl.bias_backends)}"
        methods = [m for m in CONTEXT_ATTENTION if rope.ok(f"context:{m}")]
        rows.append(
            f"| `{kernel}` | {'/'.join(impl.backends)} | {', '.join(masks)} | "
            f"{bias if biased else 'no'} | {'yes' if impl.softcap else 'no'} | "
            f"{'yes' if rope.ok('decode') else 'no'} | {', '.join(methods) or 'no'} |"
        )
    return "\n".join(rows) + "\n"


def _has_bias(cell: Cell) -> bool:
    """Whether the cell trains and its scheme adds a bias to the scores."""
    return cell.ok("train") and cell.config.position.bias(cell.config,
                                                          bidirectional=False) is not None
