"""``passkey@L``: passkey retrieval in L tokens of filler (``[eval] passkey``): the share of
trials, at each depth of the passkey, whose digits the model completes greedily. The same
keys for every cell and seed, so the trials pair."""

from __future__ import annotations

from typing import Any

from transformers_jax.sweep.scores.base import Job, ScoreKind, scored_length
from transformers_jax.sweep.terms import (
    SpecError,
    parse_length,
    positive_int,
    unknown_keys,
)

KEYS = {"lengths", "trials", "depths", "digits"}


class Passkey(ScoreKind):
    higher_is_better = True
    term_help = "passkey@L (passkey retrieval)"
    table = "passkey"  # [eval] passkey = true, or a table of its settings
    keyed_when_absent = True

    def parse_table(self, value: Any, default_lengths: list) -> dict:
        """``[eval] passkey``: ``true`` or a table (lengths, trials, depths, digits)."""
        where = "[eval] passkey"
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise SpecError(f"{where}: true, or a table {{trials = 8, depths = [0.0, 0.5, "
                            "1.0], digits = 5}")
        unknown_keys(value, KEYS, where)
        depths = value.get("depths", [0.0, 0.5, 1.0])
        if not isinstance(depths, list) or not depths or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1
                for d in depths):
            raise SpecError(f"{where} depths = {depths!r}: a list of fractions in [0, 1]")
        lengths = value.get("lengths", default_lengths)
        if not isinstance(lengths, list) or not lengths:
            raise SpecError(f"{where} lengths: a non-empty list (default: [eval] lengths)")
        return {"lengths": tuple(parse_length(x, f"{where} lengths") for x in lengths),
                "trials": positive_int(value.get("trials", 8), f"{where} trials"),
                "depths": [float(d) for d in depths],
                "digits": positive_int(value.get("digits", 5), f"{where} digits")}

    def record(self, settings: dict) -> dict:
        return {**settings, "lengths": [x.text for x in settings["lengths"]]}

    def check_term(self, kind, length, spec, where, text) -> None:
        if spec.passkey is None:
            raise SpecError(f"{where}: {text!r} needs passkey retrieval; set [eval] passkey = "
                            "true (or a table of its settings)")
        scored_length(length, spec.passkey["lengths"], "[eval] passkey lengths", text, where)

    def notes(self, spec) -> list[str]:
        if not spec.passkey:
            return []
        return ["passkey@L: whole-key accuracy of passkey retrieval in prompts of L tokens, "
                f"{spec.passkey['trials']} keys at each depth in {spec.passkey['depths']}, "
                "decoded greedily"]

    def scored(self, spec):
        return [(self.name, x) for x in spec.passkey["lengths"]] if spec.passkey else []

    def score(self, job: Job) -> dict:
        import numpy as np

        from transformers_jax.evaluation import passkey_accuracy

        settings, out = job.plan.spec.passkey, {}
        for length_spec in settings["lengths"] if settings else ():
            length = length_spec.resolve(job.planned.reference_len)
            # the same keys for every cell and seed, so the trials pair
            found = passkey_accuracy(job.model, job.params, job.tokenizer, [length],
                                     settings["depths"], settings["trials"],
                                     settings["digits"], seed=0)
            correct = [float(t["correct"]) for c in found["cells"] for t in c["trials"]]
            out[length_spec.text] = {"tokens": length, "mean": float(np.mean(correct)),
                                     "chunks": correct}
        return {self.name: out}
