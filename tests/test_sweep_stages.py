"""tjax sweep cells that start from another cell's runs, seed by seed: a fine-tune trains from
the parent's run of its seed, a zero-shot cell scores it with other model options and trains
nothing; parents train first, a retrained parent is never mixed with its old children, and
the spec's mistakes are refused by name. Also the RoPE-extension spec, planned without
training, and the bands its comment states."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
from sweep_runs import plots_at_the_end, record_trained

from transformers_jax.cli import main
from transformers_jax.runs.lock import RunLock
from transformers_jax.study import provenance
from transformers_jax.sweep import command, runner
from transformers_jax.sweep.cells import expand, pairs
from transformers_jax.sweep.plan import make_plan
from transformers_jax.sweep.spec import SpecError, parse_spec, read_spec

SPEC = """
title = "stages"
seeds = 2

[base]
args = ["--model.position=rope", "--model.d_model=16", "--model.n_layers=1",
  "--model.n_heads=2", "--train.seq_len=32", "--train.eval_every=1000",
  "--train.checkpoint_every=1000", "--train.log_every=1000", "--train.tensorboard=false"]
tokens = 1024
tokens_per_step = 128

[[cell]]
name = "base"

[[cell]]
name = "zs"
from = "base"
train = false
"model.position.scaling" = {name = "linear", factor = 2, original_max_len = "1x"}

[[cell]]
name = "tuned"
from = "base"
tokens = 128
"train.seq_len" = "2x"
"train.learning_rate" = 1e-9
"train.warmup_steps" = 0
"model.position.scaling" = {name = "linear", factor = 2, original_max_len = "1x"}

[[cell]]
name = "as-is"
from = "base"
train = false

[heldout]
bytes = 4000

[eval]
lengths = ["1x", "2x"]
chunk_tokens = 250

[baselines]
ngram = [2]

[[compare]]
a = "tuned"
b = "zs"
metric = "loss@2x"
"""

CODE = {"commit": "a" * 40, "dirty": False, "source_sha256": "1" * 64}


def _patched(mp: pytest.MonkeyPatch, root) -> list[str]:
    """The sweep's code state fixed, its split cache in ``root``; every seed trained recorded."""
    mp.setenv("TJAX_SPLIT_CACHE", str(root / "splits"))
    mp.setattr(provenance, "code_state", lambda: dict(CODE))
    plots_at_the_end(mp)
    return record_trained(mp)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One sweep of SPEC, trained once for the tests that read it."""
    root = tmp_path_factory.mktemp("stages")
    spec = root / "stages.toml"
    spec.write_text(SPEC)
    with pytest.MonkeyPatch.context() as mp:
        calls = _patched(mp, root)
        assert main(["sweep", str(spec), "--out", str(root / "out")]) == 0
    return root, spec, calls


@pytest.fixture
def copied(swept, tmp_path, monkeypatch):
    """The trained sweep to change (a run's config names its folder, so it stays where it
    is), put back as it was afterwards; with the same patches."""
    root, spec, _ = swept
    out = root / "out"
    shutil.copytree(out, tmp_path / "kept")
    yield out, spec, _patched(monkeypatch, root)
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "kept", out)


# ---------------------------------------------------------------------------- whole sweeps


@pytest.mark.slow
def test_parents_train_first_and_a_zero_shot_cell_trains_nothing(swept):
    root, _, calls = swept
    out = root / "out"
    # base's seeds as one program, then the fine-tune's seed by seed; zs never trains
    assert calls == ["base/0", "base/1", "tuned/0", "tuned/1"]
    assert sorted(os.listdir(out / "cells/zs/seed0")) == [runner.SCORES_FILE]
    zs = json.loads((out / "cells/zs/seed1" / runner.SCORES_FILE).read_text())
    assert zs["zero_shot"] and zs["scored_run"] == str((out / "cells/base/seed1").resolve())
    record = json.loads((out / "cells/zs" / runner.CELL_FILE).read_text())
    assert record["zero_shot"] and record["command"] is None
    assert record["parent"]["key"] == json.loads(
        (out / "cells/base" / runner.CELL_FILE).read_text())["key"]

    # each fine-tune seed starts from the parent's run of the same seed, and says so
    readme = (out / "cells/tuned/seed1/README.md").read_text()
    assert f"--train.init_from={out / 'cells/base/seed1'}" in readme
    assert "--train.seq_len=64" in readme
    source = json.loads((out / "cells/tuned/seed1" / runner.FROM_FILE).read_text())
    assert source["run"] == str((out / "cells/base/seed1").resolve())

    results = json.loads((out / "results.json").read_text())
    cells = {c["name"]: c for c in results["cells"]}
    assert [c["name"] for c in results["cells"]] == ["base", "zs", "tuned", "as-is"]
    # a zero-shot cell with its source's own model takes that run's scores
    for seed in (0, 1):
        same = json.loads((out / f"cells/as-is/seed{seed}" / runner.SCORES_FILE).read_text())
        base = json.loads((out / f"cells/base/seed{seed}" / runner.SCORES_FILE).read_text())
        assert same["zero_shot"] and same["loss"] == base["loss"] and same["key"] != base["key"]
    assert (cells["zs"]["steps"], cells["zs"]["tokens"], cells["zs"]["tokens_seen"]) == (
        0, 0, 1024)
    assert (cells["tuned"]["seq_len"], cells["tuned"]["tokens"],
            cells["tuned"]["tokens_seen"]) == (64, 128, 1152)
    # lengths of a child are multiples of its chain's first training length (32), not of 64
    assert [e["tokens"] for e in cells["tuned"]["by_length"]] == [32, 64]
    # a budget's baseline is fitted on the tokens behind the weights, the parent's included
    assert set(results["baselines"]) == {"1024", "1152"}
    (row,) = results["comparisons"]
    assert row["verdict"] != "pending"
    report = (out / "report.md").read_text()
    assert "| zs | base (zero-shot) | 0 | 1,024 (0 own) |" in report
    assert "| tuned | base (fine-tune) | 1 | 1,152 (128 own) |" in report


@pytest.mark.slow
def test_a_zero_shot_cell_scores_the_parents_run_with_its_model(swept):
    from transformers_jax import ModelConfig, Rope
    from transformers_jax.evaluation import stream_losses
    from transformers_jax.models import build_model
    from transformers_jax.nn.positions.rope_scaling import Linear
    from transformers_jax.runs.load import load_run
    from transformers_jax.study.stats import block_means

    root, spec, _ = swept
    out = root / "out"
    plan = make_plan(read_spec(str(spec)), str(out / "data"))
    for seed in (0, 1):
        _, params, _, saved = load_run(str(out / f"cells/base/seed{seed}"))
        cfg = ModelConfig(position=Rope(scaling=Linear(factor=2.0, original_max_len=32)),
                          d_model=16, n_layers=1, n_heads=2, vocab_size=saved.vocab_size)
        model = build_model(cfg)
        scores = json.loads((out / f"cells/zs/seed{seed}" / runner.SCORES_FILE).read_text())
        for text, length in (("1x", 32), ("2x", 64)):
            losses = stream_losses(model, params, plan.heldout_N, length, None, 8)
            assert scores["loss"][text]["mean"] == pytest.approx(np.nanmean(losses), rel=1e-6)
            assert scores["loss"][text]["chunks"] == pytest.approx(
                block_means(losses, 250).tolist(), rel=1e-6)
        plain = json.loads((out / f"cells/base/seed{seed}" / runner.SCORES_FILE).read_text())
        assert scores["loss"]["2x"]["mean"] != plain["loss"]["2x"]["mean"]  # the scaling acts


@pytest.mark.slow
def test_a_fine_tune_starts_from_the_parents_parameters(swept):
    """One step at a learning rate of 1e-9: the fine-tune's parameters are its parent's of the
    same seed, and it scores as the zero-shot cell with the same scaling does."""
    from transformers_jax.runs.load import load_run

    root, _, _ = swept
    out = root / "out"
    flat = {}
    for seed in (0, 1):
        for cell in ("base", "tuned"):
            _, params, _, _ = load_run(str(out / f"cells/{cell}/seed{seed}"))
            flat[cell, seed] = np.concatenate([np.ravel(x) for x in _leaves(params)])
        np.testing.assert_allclose(flat["tuned", seed], flat["base", seed], atol=1e-6)
        tuned = json.loads((out / f"cells/tuned/seed{seed}" / runner.SCORES_FILE).read_text())
        zs = json.loads((out / f"cells/zs/seed{seed}" / runner.SCORES_FILE).read_text())
        for text in ("1x", "2x"):
            assert tuned["loss"][text]["mean"] == pytest.approx(zs["loss"][text]["mean"],
                                                                abs=1e-5)
    assert np.abs(flat["tuned", 0] - flat["base", 1]).max() > 1e-2  # seed 0's from seed 0


def _leaves(tree) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_started_again_nothing_trains_or_rescored(copied):
    out, spec, calls = copied
    before = os.path.getmtime(out / "cells/zs/seed0" / runner.SCORES_FILE)
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert calls == []
    assert os.path.getmtime(out / "cells/zs/seed0" / runner.SCORES_FILE) == before


@pytest.mark.slow
def test_a_parent_trained_again_rescores_zero_shot_and_refuses_fine_tunes(copied, capsys):
    out, spec, calls = copied
    old = json.loads((out / "cells/zs/seed0" / runner.SCORES_FILE).read_text())["key"]
    shutil.rmtree(out / "cells/base")  # the same config, trained again: other runs
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    assert calls == ["base/0", "base/1"]
    new = json.loads((out / "cells/zs/seed0" / runner.SCORES_FILE).read_text())["key"]
    assert new != old  # zs (before tuned in the order) scored the new runs
    err = capsys.readouterr().err
    assert "was fine-tuned from" in err and "trained again" in err and "cells/tuned" in err


@pytest.mark.slow
def test_a_parent_with_another_config_makes_its_children_refuse(copied, capsys):
    out, spec, calls = copied
    spec = out.parent / "changed.toml"
    spec.write_text(SPEC.replace('"--train.seq_len=32",', '"--train.seq_len=32", '
                                 '"--train.learning_rate=0.001",'))
    shutil.rmtree(out / "cells/base")
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    assert calls == ["base/0", "base/1"]
    err = capsys.readouterr().err
    assert "cell zs" in err and "started from the runs of base" in err and "changed" in err


@pytest.mark.slow
def test_a_child_waits_for_a_parent_another_process_trains(copied):
    out, spec, _ = copied
    plan = make_plan(read_spec(str(spec)), str(out / "data"))
    child = next(p for p in plan.cells if p.cell.name == "tuned")
    done = [out / f"cells/base/seed{s}" / runner.DONE_FILE for s in (0, 1)]
    saved = [p.read_text() for p in done]
    for p in done:
        p.unlink()
    lines: list[str] = []
    assert not runner.parent_ready(plan, child, str(out), lines.append)  # nobody trains it
    assert "no process is training it" in lines[-1]

    holder = RunLock(str(out / "cells/base")).acquire()  # another worker, training base

    def finish():
        time.sleep(0.3)
        for p, text in zip(done, saved, strict=True):
            p.write_text(text)
        holder.release()

    thread = threading.Thread(target=finish)
    thread.start()
    assert runner.parent_ready(plan, child, str(out), lines.append, wait_seconds=0.05)
    thread.join()
    assert "waiting for base" in lines[-1]


@pytest.mark.slow
def test_a_shard_leaves_a_child_whose_parent_is_not_trained(sweep_tmp, capsys):
    root, spec, calls = sweep_tmp
    spec.write_text(SPEC.replace("seeds = 2", "seeds = 1"))
    # shard 1/2 of [base, zs, tuned]: zs, whose parent (shard 0's) is not trained
    assert main(["sweep", str(spec), "--out", str(root / "out"), "--shard", "1/2"]) == 0
    assert calls == []
    assert "left for later" in capsys.readouterr().err
    assert not (root / "out/cells/zs/seed0" / runner.SCORES_FILE).exists()


@pytest.fixture
def sweep_tmp(tmp_path, monkeypatch):
    spec = tmp_path / "stages.toml"
    spec.write_text(SPEC)
    return tmp_path, spec, _patched(monkeypatch, tmp_path)


def test_workers_take_the_depths_one_after_another(sweep_tmp, monkeypatch):
    root, spec, _ = sweep_tmp
    plan = make_plan(read_spec(str(spec)), str(root / "data"))
    runs = []
    monkeypatch.setattr(command, "run_shards",
                        lambda cmd, cores: runs.append((cmd[-1], len(cores))) or [])
    command.run_workers(["sweep", str(spec), "--out", "o", "--workers", "2"], 2, plan, None)
    assert runs == [("--depth=0", 1), ("--depth=1", 2)]  # one cell at depth 0: one worker


# ---------------------------------------------------------------------------- the spec


def _spec(**changes) -> str:
    text = SPEC
    for old, new in changes.values():
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("change, fragments", [
    (('from = "base"\ntrain = false', 'from = "bsae"\ntrain = false'),
     ["cell zs: from = 'bsae' names no cell", "base, tuned"]),
    (('name = "base"\n', 'name = "base"\nfrom = "tuned"\ntokens = 64\n'),
     ["cycle", "base -> tuned -> base"]),
    (('name = "zs"\nfrom = "base"\n', 'name = "zs"\nfrom = "zs"\n'), ["names itself"]),
    (('from = "base"\ntrain = false', 'train = false'), ["train = false scores another cell"]),
    (('train = false\n', 'train = false\n"train.learning_rate" = 0.1\n'),
     ["zero-shot", "train.learning_rate has no effect"]),
    (('tokens = 128\n', ''), ["needs a budget of its own", "tokens = N"]),
    (('tokens = 128\n', 'tokens = 128\nseeds = [0]\n'), ["seeds are the spec's"]),
    (('train = false', 'train = "no"'), ["train = 'no'"]),
    (('tokens = 128\n', 'tokens = 128\nparent = "base"\n'), ["'parent' is not model.FIELD"]),
])
def test_spec_errors_name_the_cell_and_the_fix(change, fragments):
    with pytest.raises(SpecError) as err:
        spec = parse_spec(_spec(change=change))
        pairs(spec, expand(spec))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_multiple_of_seq_len_for_seq_len_needs_a_parent(sweep_tmp):
    root, _, _ = sweep_tmp
    spec = parse_spec(_spec(change=('name = "base"\n', 'name = "base"\n"train.seq_len" = "2x"\n'
                                    )))
    with pytest.raises(SpecError, match="for a cell that starts from another"):
        make_plan(spec, str(root / "data"))


def test_a_fine_tune_past_an_epoch_counts_its_parents_tokens(sweep_tmp):
    root, _, _ = sweep_tmp
    plan = make_plan(parse_spec(SPEC), str(root / "data"))
    room = plan.train_N.size - 1024  # what the base leaves of one epoch
    spec = parse_spec(_spec(change=("tokens = 128\n", f"tokens = {room + 64}\n")))
    with pytest.raises(SpecError, match="with its parents'"):
        make_plan(spec, str(root / "data"))


STAGES = """
seeds = 1
[base]
args = "--model.position=rope --train.seq_len=64"
tokens = 1000
[[cell]]
name = "rope"
[axes]
"model.position.scaling" = ["none", {name = "linear", factor = 2, original_max_len = "1x"}]
[[stage]]
name = "zs"
from = "rope"
train = false
[[stage]]
name = "ft"
from = "rope"
tokens = 500
"train.seq_len" = "2x"
[[stage]]
name = "ft2"
from = "ft"
tokens = 500
[[compare]]
against = {scaling = "none"}
metric = "loss@1x"
[[compare]]
a = {stage = "ft"}
b = {stage = "zs"}
metric = "loss@1x"
"""


def test_stages_take_the_product_once_each_and_pair_on_the_other_axes():
    spec = parse_spec(STAGES)
    cells = expand(spec)
    assert [(c.name, c.parent, c.trains) for c in cells] == [
        ("rope", None, True),
        ("stage=zs,scaling=none", "rope", False), ("stage=zs,scaling=linear", "rope", False),
        ("stage=ft,scaling=none", "rope", True), ("stage=ft,scaling=linear", "rope", True),
        # a stage from a stage: each cell from the one with its axis values
        ("stage=ft2,scaling=none", "stage=ft,scaling=none", True),
        ("stage=ft2,scaling=linear", "stage=ft,scaling=linear", True)]
    assert cells[2].args == ("--model.position.scaling=linear",
                             "--model.position.scaling.factor=2",
                             "--model.position.scaling.original_max_len=1x")
    found = [(p.a.name, p.b.name) for p in pairs(spec, cells)]
    assert found == [("stage=zs,scaling=linear", "stage=zs,scaling=none"),
                     ("stage=ft,scaling=linear", "stage=ft,scaling=none"),
                     ("stage=ft2,scaling=linear", "stage=ft2,scaling=none"),
                     ("stage=ft,scaling=none", "stage=zs,scaling=none"),
                     ("stage=ft,scaling=linear", "stage=zs,scaling=linear")]
    with pytest.raises(SpecError, match="'stage' is not an axis"):  # no stages, no such axis
        plain = parse_spec(STAGES.split("[[stage]]")[0] + '[[compare]]\na = {stage = "x"}\n'
                           'b = {scaling = "none"}\nmetric = "loss@1x"\n')
        pairs(plain, expand(plain))
    with pytest.raises(SpecError, match="cycle"):
        spec = parse_spec(STAGES.replace('from = "rope"\ntokens = 500', 'from = "ft2"\n'
                                         'tokens = 500'))
        expand(spec)


def test_any_cell_or_stage_table_is_read_or_refused_with_a_spec_error():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from profiles import examples

    from transformers_jax.sweep.spec import spec_from_dict

    value = st.one_of(st.integers(-2, 600), st.booleans(), st.sampled_from(
        ["a", "b", "rope", "2x", "none", ""]), st.dictionaries(
        st.sampled_from(["name", "factor"]), st.sampled_from(["linear", 2, "1x"]), max_size=2))
    table = st.dictionaries(st.sampled_from(
        ["name", "from", "train", "tokens", "train.steps", "train.seq_len", "seeds", "junk",
         "model.position.scaling"]), value, max_size=5)

    @settings(max_examples=examples(ci=50, thorough=200), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(table, max_size=3), st.lists(table, max_size=2))
    def check(cells, stages):
        try:
            spec = spec_from_dict({"cell": cells, "stage": stages, "axes": {
                "model.position.scaling": ["none", "linear"]}})
            pairs(spec, expand(spec))
        except SpecError as err:
            assert str(err)

    check()


# ---------------------------------------------------------------------------- RoPE extension

ROPE_SPEC = os.path.join(os.path.dirname(__file__), "..", "experiments", "specs",
                         "rope_extension.toml")


def test_the_rope_extension_spec_plans_without_training(tmp_path, monkeypatch, capsys):
    from transformers_jax.sweep.plan import resolve_cells

    spec = read_spec(ROPE_SPEC)
    planned = resolve_cells(spec)
    names = [p.cell.name for p in planned]
    scalings = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
    assert names == ["rope"] + [f"stage={s},scaling={x}" for s in ("zero-shot", "fine-tuned")
                                for x in scalings]
    base = planned[0]
    assert (base.train.seq_len, base.model.dims_per_head, base.model.position.base) == (
        512, 64, 10000.0)
    assert base.train.data == "tfds:tjax_linux_source/docs"
    for cell in planned[1:]:
        assert cell.parent is base and cell.lengths(spec) == [512, 1024, 2048, 4096, 8192]
        scaling = cell.model.position.scaling
        if scaling.name != "none":
            assert (scaling.factor, scaling.original_max_len) == (4.0, 512)
        if cell.zero_shot:
            assert cell.tokens == 0 and cell.train == base.train
        else:
            assert cell.train.seq_len == 2048 and cell.train.init_from is None
            # a fine-tune's tokens count with its parent's against the one-epoch limit: the
            # base's 977 whole steps of 2048 and its own 128
            assert cell.tokens_seen == (977 + 128) * 2048
    found = pairs(spec, expand(spec))
    claims = [p for p in found if p.claim.startswith(("Peng", "Chen"))]
    assert [(p.a.name, p.b.name, p.metric.text) for p in claims] == [
        ("stage=fine-tuned,scaling=yarn", "stage=fine-tuned,scaling=linear", "loss@4x"),
        ("stage=fine-tuned,scaling=yarn", "stage=fine-tuned,scaling=ntk", "loss@4x"),
        ("stage=fine-tuned,scaling=linear", "stage=fine-tuned,scaling=none", "sliding@4x")]
    against = [p for p in found if p.index in (1, 2)]
    assert len(against) == 20 and all(p.b.values["scaling"] == "none" for p in against)

    # The dry run prints every cell. The corpus is not prepared here: the built-in text and
    # byte tokens stand in, with budgets cut to fit it (timings stubbed: nothing compiles).
    monkeypatch.setenv("TJAX_SPLIT_CACHE", str(tmp_path / "splits"))
    text = open(ROPE_SPEC).read()
    text = text.replace("--data tfds:tjax_linux_source/docs --train.tokenizer=sentencepiece_bpe"
                        " \\\n  --train.tokenizer_vocab=4096", "--train.tokenizer=byte")
    text = text.replace("tokens = 2_000_000", "tokens = 20_000").replace(
        "tokens = 262_144", "tokens = 4096").replace("bytes = 400_000", "bytes = 40_000")
    assert "tjax_linux_source" not in text.split("[base]")[1]
    plan = make_plan(parse_spec(text), str(tmp_path / "data"))
    assert [c.cell.name for c in plan.cells] == names
    monkeypatch.setattr(command, "_step_seconds", lambda planned, tokenizer: 0.5)
    monkeypatch.setattr(command, "_eval_seconds", lambda planned, plan, cache: 1.0)
    command.dry_run(plan)
    out = capsys.readouterr().out
    assert "13 cells x 3 seeds = 39 runs; 23 comparisons declared" in out
    assert "rope (zero-shot)" in out and "rope (fine-tune)" in out


def test_the_rope_extension_bands_are_where_the_spec_says(tmp_path, monkeypatch):
    """The comment's table: which RoPE pairs YaRN and Llama 3 keep, blend and divide by 4."""
    monkeypatch.setenv("TJAX_SPLIT_CACHE", str(tmp_path / "splits"))
    from transformers_jax.nn.positions.rope_scaling import default_inv_freq
    from transformers_jax.sweep.plan import resolve_cells

    cells = {p.cell.name: p for p in resolve_cells(read_spec(ROPE_SPEC))}
    base = cells["rope"]
    d = base.model.dims_per_head
    plain = default_inv_freq(base.model.position.base, d)
    bands = {}
    for name in ("yarn", "llama3"):
        rule = cells[f"stage=fine-tuned,scaling={name}"].model.position.scaling
        ratio = plain / rule.inv_freq(base.model.position.base, d)[0]
        bands[name] = ([i for i, r in enumerate(ratio) if r == pytest.approx(1.0, abs=1e-5)],
                       [i for i, r in enumerate(ratio) if r == pytest.approx(4.0, abs=1e-4)])
    assert bands["yarn"] == (list(range(0, 4)), list(range(16, 32)))
    assert bands["llama3"] == (list(range(0, 11)), list(range(16, 32)))
    turns = 512 / (2 * np.pi / plain)  # rotations over L0: YaRN's r
    assert turns[3] > 32 > turns[4] and turns[15] > 1 > turns[16]


# ----------------------------------------------------------------- length extrapolation

LENGTH_SPEC = os.path.join(os.path.dirname(__file__), "..", "experiments", "specs",
                           "length_extrapolation.toml")


@pytest.mark.parametrize("name, lengths", [("length_extrapolation.toml", 3),
                                           ("length_extrapolation_cpu.toml", 1)])
def test_the_length_extrapolation_specs_cover_every_positional_scheme(name, lengths):
    """Every registered positional scheme is a value of each spec's position axis (a scheme
    registered later fails here until the experiment includes it), and each declared claim is
    a pair at every training length; resolved without data (the research corpus is not
    prepared here)."""
    from transformers_jax.registry import POSITIONS

    spec = read_spec(os.path.join(os.path.dirname(LENGTH_SPEC), name))
    cells = expand(spec)
    position = next(a for a in spec.axes if a.key == "model.position")
    names = {v["name"] if isinstance(v, dict) else v for v in position.values}
    assert names == set(POSITIONS.names())
    assert len(cells) == len(names) * lengths and len(spec.seeds) >= 3
    found = pairs(spec, cells)
    assert len(found) == lengths * len(spec.compares) == lengths * 36
    assert {p.metric.text for p in found} == {"loss@4x", "loss@16x"}


def test_the_length_extrapolation_spec_scales_settings_with_the_training_length():
    from transformers_jax.sweep.plan import in_tokens

    cells = expand(read_spec(LENGTH_SPEC))
    fire = in_tokens(next(c for c in cells if c.name == "position=fire,seq_len=128"))
    assert "--model.position.init_threshold=32" in fire.args
    learned = in_tokens(next(c for c in cells if c.name == "position=learned,seq_len=32"))
    assert "--model.max_len=512" in learned.args  # rows for every evaluated position
