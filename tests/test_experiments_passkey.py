"""Passkey retrieval (experiments.passkey): windows, mixing, and the scorer against an ideal
retriever (must retrieve every key) and a constant one (must retrieve none)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import passkey
from transformers_jax.data.tokenizers import ByteTokenizer

FILLER = b"the quick brown fox jumps over a lazy dog " * 200  # no digits, no "$"


class Retriever:
    """The ideal retriever of the format: at ``offset`` tokens after the latest "$", predicts
    the token at the same offset after the "$" before it (0 where there is none)."""

    def apply(self, variables, inputs_BT):
        T = inputs_BT.shape[1]
        t_T = jnp.arange(T)
        dollar_BT = inputs_BT == ord("$")
        last_BT = jax.lax.cummax(jnp.where(dollar_BT, t_T, -1), axis=1)
        # the "$" before the latest one: the latest at the position before it
        shifted_BT = jnp.pad(last_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        prev_BT = jnp.take_along_axis(shifted_BT, jnp.clip(last_BT, 0, T - 1), axis=1)
        source_BT = prev_BT + (t_T - last_BT) + 1
        ok_BT = (last_BT >= 0) & (prev_BT >= 0) & (source_BT < T)
        following = jnp.take_along_axis(inputs_BT, jnp.clip(source_BT, 0, T - 1), axis=1)
        return jax.nn.one_hot(jnp.where(ok_BT, following, 0), 262)


class Constant:
    def apply(self, variables, inputs_BT):
        return jnp.zeros((*inputs_BT.shape, 262)).at[..., ord("7")].set(1.0)


# each stand-in's argmax traced once (``passkey.predictor`` makes a new jit per call); the
# grid below still goes through ``predictor``
RETRIEVER_ARGMAX = jax.jit(lambda params, inputs: Retriever().apply(None, inputs).argmax(-1))
CONSTANT_ARGMAX = jax.jit(lambda params, inputs: Constant().apply(None, inputs).argmax(-1))


@pytest.mark.parametrize("depth", passkey.DEPTHS)
def test_windows_hold_one_key_at_its_depth_and_end_with_it(depth):
    tok = ByteTokenizer()
    windows, answer = passkey.examples(FILLER, tok, 96, depth, 4)
    assert windows.shape == (4, 96) and answer.tolist() == list(range(90, 95))
    for w in windows:
        text = bytes(w.astype(np.uint8))
        assert text.count(b"$") == 2 and text.endswith(b" ")
        key_at = text.index(b"$")
        key, query = text[key_at + 1 : key_at + 6], text[-6:-1]
        assert key == query and key.isdigit()
        assert abs(key_at - depth * 82) <= 1  # 96 - 2 * 7 bytes of filler, key at that share


@pytest.mark.slow
def test_scorer_against_ideal_and_constant_models():
    tok = ByteTokenizer()
    windows, answer = passkey.examples(FILLER, tok, 64, 0.5, 10)
    ideal = dict(argmax=RETRIEVER_ARGMAX)
    assert passkey.retrieved(Retriever(), None, windows, answer, **ideal).tolist() == [1.0] * 10
    assert passkey.retrieved(Constant(), None, windows, answer, argmax=CONSTANT_ARGMAX).sum() == 0
    # one wrong digit is a miss: the key is retrieved only whole
    broken = windows.copy()
    broken[:, answer[2] - 12] = ord("x")  # a filler byte: the ideal model is unaffected
    assert passkey.retrieved(Retriever(), None, broken, answer, **ideal).sum() == 10
    broken[:, answer[-1]] = ord("$")  # the last digit is now not the key's
    assert passkey.retrieved(Retriever(), None, broken, answer, **ideal).sum() == 0
    grid = passkey.accuracy_grid(Retriever(), None, FILLER, tok, [32, 64], 3)
    assert passkey.control_passed(grid, 32) and set(grid) == {"32", "64"}


def test_too_short_a_window_is_refused():
    with pytest.raises(ValueError, match="too short for a passkey window"):
        passkey.examples(FILLER, ByteTokenizer(), 12, 0.5, 1)


def test_mixing_keeps_the_text_and_pairs_each_key_with_its_query():
    rng = np.random.default_rng(0)
    mixed = passkey.mix_pairs(FILLER, rng, short_gap=20, long_gap=80, every=64)
    parts = mixed.split(b"$")
    assert len(parts) % 2 == 1 and len(parts) > 20
    keys = [p[:5] for p in parts[1:]]
    assert all(k.isdigit() for k in keys) and keys[0::2] == keys[1::2]
    text = b"".join([parts[0], *[p[6:] for p in parts[1:]]])  # the pairs taken out again
    assert text == FILLER
    # a "$" of the text itself is taken out: only keys and queries carry the marker
    priced = passkey.mix_pairs(b"it costs $5 " + FILLER, np.random.default_rng(0), 20, 80, 64)
    assert priced.startswith(b"it costs 5 ")
    assert all(p[:5].isdigit() for p in priced.split(b"$")[1:])


def test_copies_of_the_training_text_carry_their_own_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("TJAX_SPLIT_CACHE", str(tmp_path))

    class Split:
        def train_texts(self):
            return [FILLER[:3000], FILLER[:2000]]

    folder, meta = passkey.mixed_training_data(Split(), 64, 4, every=64, copies=3)
    files = sorted(os.listdir(folder))
    texts = [open(os.path.join(folder, f), "rb").read() for f in files]
    assert len(texts) == 6 and meta["copies"] == 3 and 0 < meta["pair_bytes_share"] < 0.3
    for text in texts:  # each copy is the document with pairs mixed in
        parts = text.split(b"$")
        assert b"".join([parts[0], *[p[6:] for p in parts[1:]]]) in (FILLER[:3000], FILLER[:2000])
    keys = [tuple(p[:5] for p in t.split(b"$")[1::2]) for t in texts]
    assert len(set(keys)) == 6  # no copy repeats another's keys
    one, _ = passkey.mixed_training_data(Split(), 64, 4, every=64)
    assert len(os.listdir(one)) == 2
    with pytest.raises(ValueError, match="copies"):
        passkey.mixed_training_data(Split(), 64, 4, copies=0)


@pytest.mark.slow
def test_passkey_budget_scores_every_checkpoint_of_one_run(results_dir, split_cache):
    import json

    from experiments import passkey_budget

    passkey_budget.main(["--scale", "tiny", "--steps", "8", "--every", "4", "--per-cell", "2",
                         "--copies", "2"])
    out = json.loads((results_dir / "passkey_budget_tiny_copies2.json").read_text())
    rows = out["by_step"]
    assert [r["step"] for r in rows] == [4, 8]
    assert [r["tokens"] for r in rows] == [4 * 4 * 32, 8 * 4 * 32]  # tiny: batch 4, L 32
    for r in rows:
        assert set(r["by_depth"]) == {f"{d:g}" for d in passkey.DEPTHS}
        assert r["accuracy"] == np.mean(list(r["by_depth"].values()))
        assert 0 <= r["digit_accuracy"] <= 1 and r["digit_accuracy"] >= r["accuracy"]
        assert 0 < r["heldout_loss"] < 10
    # the two checkpoints are one run's, not two runs: later is better trained
    assert rows[1]["heldout_loss"] < rows[0]["heldout_loss"]
    assert out["train"]["steps"] == 8 and out["passkey_data"]["pairs_every_bytes"] == 32
    assert out["passkey_data"]["copies"] == 2
    assert "| 8 |" in (results_dir / "passkey_budget_tiny_copies2.md").read_text()


def test_passkey_budget_refuses_checkpoints_that_do_not_divide_the_run():
    from experiments import passkey_budget

    with pytest.raises(SystemExit):
        passkey_budget.main(["--scale", "tiny", "--steps", "10", "--every", "4"])
