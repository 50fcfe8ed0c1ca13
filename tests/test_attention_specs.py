"""The committed specs of the attention-variants experiment's stability and prefix parts:
they read, plan and pair as their comments say (the sweeps themselves are too long for a
test)."""

from __future__ import annotations

from pathlib import Path

from transformers_jax.sweep.cells import expand, pairs
from transformers_jax.sweep.spec import read_spec

SPECS = Path(__file__).resolve().parents[1] / "experiments/specs"


def test_the_committed_stability_spec_pairs_each_variant_with_its_own_sane_rate():
    from transformers_jax.sweep.plan import resolve_cells

    spec = read_spec(str(SPECS / "attention_stability.toml"))
    planned = {p.cell.name: p for p in resolve_cells(spec)}
    assert len(planned) == 9
    qk = planned["stage=qk_norm,learning_rate=0.2"]
    cap = planned["stage=softcap,learning_rate=0.02"]
    base = planned["stage=baseline,learning_rate=0.002"]
    assert (qk.model.qk_norm, qk.model.attn_logit_softcap, qk.train.learning_rate) == (
        True, None, 0.2)
    assert (cap.model.qk_norm, cap.model.attn_logit_softcap) == (False, 50.0)
    assert (base.model.qk_norm, base.model.attn_logit_softcap) == (False, None)
    assert {p.model.attention.name for p in planned.values()} == {"reference"}
    assert {(p.train.seq_len, p.train.batch_size, p.train.steps) for p in planned.values()} == {
        (64, 16, 977)}
    found = pairs(spec, expand(spec))
    assert len(found) == 10
    # every relative comparison subtracts the same variant at 2e-3
    for p in found:
        for cell, ref in ((p.a, p.a_ref), (p.b, p.b_ref)):
            if ref is not None:
                assert ref.values == {**cell.values, "learning_rate": "0.002"}
    assert sum(p.a_ref is not None for p in found) == 8


def test_the_committed_prefix_spec_plans_a_decoder_two_ways_and_an_encoder_decoder(tmp_path):
    from transformers_jax.sweep.plan import make_plan

    plan = make_plan(read_spec(str(SPECS / "attention_prefix.toml")), str(tmp_path))
    cells = {c.cell.name: c for c in plan.cells}
    assert {n: (c.model.family, c.model.mask.name, c.train.seq_len)
            for n, c in cells.items()} == {
        "causal": ("gpt", "causal", 26), "prefix": ("gpt", "prefix", 26),
        "encdec": ("encdec", "causal", 13)}
    assert {(c.train.task, c.train.steps, c.train.batch_size, c.train.learning_rate)
            for c in cells.values()} == {("reverse", 600, 32, 1e-3)}
    assert [(p.a.name, p.b.name, p.metric.text) for p in plan.pairs] == [
        ("prefix", "causal", "exact@1-12"), ("encdec", "prefix", "exact@1-12"),
        ("encdec", "causal", "exact@1-12"), ("prefix", "causal", "exact@10-12")]
