"""Masked-LM corruption: the 15% / 80-10-10 recipe, measured, and its purity in the key.

Statistical bound used throughout: for a category with true share p among N chosen tokens, the
observed share has standard error sqrt(p (1 - p) / N); every check asserts |observed - p| below
5 standard errors. For a correct implementation that fails with probability < 6e-7 per check
(the keys are fixed, so the test is deterministic anyway); with N of about 60k chosen tokens,
5 SE is about 0.8 points for p = 0.8 and 0.6 points for p = 0.1, so a split that is off by a
percentage point is caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import ModelConfig, build_model
from transformers_jax.data.mlm import (
    BERT_MASKING,
    MaskingConfig,
    mask_batch,
    mask_tokens,
    special_ids_of,
)
from transformers_jax.data.mlm_batches import mlm_batch
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.learning.objectives import mlm_objective, objective_for

TOK = ByteTokenizer()
SPECIAL = special_ids_of(TOK)
MASK = TOK.special["mask"]
N_ORDINARY = TOK.vocab_size - len(SPECIAL)  # 256 bytes
B, T, N_BATCHES = 256, 64, 40


def make_rows(seed: int):
    """Random ids (specials included) with a random-length real part; the rest is padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TOK.vocab_size, size=(B, T)).astype(np.int32)
    lengths = rng.integers(T // 4, T + 1, size=B)
    lengths[:8] = np.arange(1, 9)  # a few very short rows: at least one token is still chosen
    valid = np.arange(T)[None] < lengths[:, None]
    tokens[~valid] = TOK.pad_id
    return tokens, valid


def corrupt(key, tokens, valid, config=BERT_MASKING):
    out = mask_tokens(key, tokens, mask_id=MASK, special_ids=SPECIAL, vocab_size=TOK.vocab_size,
                      config=config, valid_BT=valid)
    return {k: np.asarray(v) for k, v in out.items()}


def within(observed: float, p: float, n: int, sigmas: float = 5.0) -> bool:
    return abs(observed - p) < sigmas * np.sqrt(p * (1 - p) / n)


def collect(config: MaskingConfig):
    """Counts over N_BATCHES batches (one compiled shape, a fresh key each)."""
    totals = dict(eligible=0, chosen=0, masked=0, randomised=0, unchanged=0)
    rows = []
    for i in range(N_BATCHES):
        tokens, valid = make_rows(i)
        out = corrupt(jax.random.key(i), tokens, valid, config)
        eligible = valid & ~np.isin(tokens, SPECIAL)
        chosen = out["weights"] > 0
        inputs = out["inputs"]
        # never padding or special; nothing else touched; targets are the original tokens
        assert not np.any(chosen & ~eligible)
        np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])
        np.testing.assert_array_equal(out["targets"], tokens)
        # random replacements are ordinary tokens, never a special id
        assert not np.any(np.isin(inputs[chosen & (inputs != MASK)], SPECIAL))
        totals["eligible"] += int(eligible.sum())
        totals["chosen"] += int(chosen.sum())
        totals["masked"] += int((chosen & (inputs == MASK)).sum())
        totals["randomised"] += int((chosen & (inputs != MASK) & (inputs != tokens)).sum())
        totals["unchanged"] += int((chosen & (inputs == tokens)).sum())
        rows.append((eligible.sum(-1), chosen.sum(-1)))
    return totals, rows


def test_bert_recipe_proportions():
    config = MaskingConfig()
    totals, rows = collect(config)
    n = totals["chosen"]
    assert n > 50_000
    # Exactly round(15% of n eligible) per row (at least 1): BERT's recipe, no sampling noise.
    for eligible, chosen in rows:
        target = 0.15 * eligible
        rounded = target >= 0.5
        assert np.all(np.abs(chosen - target)[rounded] <= 0.5 + 1e-4)
        assert np.all(chosen[~rounded & (eligible > 0)] == 1)
        assert np.all(chosen[eligible == 0] == 0)
    assert abs(n / totals["eligible"] - 0.15) < 0.005  # rounding only
    # A random replacement equals the original with probability 1/256: it then looks unchanged.
    p_random = 0.1 * (1 - 1 / N_ORDINARY)
    p_unchanged = 0.1 + 0.1 / N_ORDINARY
    assert within(totals["masked"] / n, 0.8, n), totals
    assert within(totals["randomised"] / n, p_random, n), totals
    assert within(totals["unchanged"] / n, p_unchanged, n), totals


def test_configurable_rate_and_split_with_bernoulli_choice():
    config = MaskingConfig(rate=0.3, mask_fraction=0.5, random_fraction=0.3, exact_count=False)
    totals, _ = collect(config)
    n, n_eligible = totals["chosen"], totals["eligible"]
    assert within(n / n_eligible, 0.3, n_eligible), totals
    assert within(totals["masked"] / n, 0.5, n), totals
    assert within(totals["randomised"] / n, 0.3 * (1 - 1 / N_ORDINARY), n), totals
    assert within(totals["unchanged"] / n, 0.2 + 0.3 / N_ORDINARY, n), totals


def test_random_replacements_cover_the_ordinary_vocabulary():
    tokens = np.full((B, T), ord("a"), np.int32)
    config = MaskingConfig(rate=1.0, mask_fraction=0.0, random_fraction=1.0)
    out = corrupt(jax.random.key(3), tokens, None, config)
    drawn = out["inputs"].ravel()
    assert set(np.unique(drawn)) <= set(range(256))
    assert len(np.unique(drawn)) == 256  # B*T = 16k draws over 256 ids: all of them appear
    counts = np.bincount(drawn, minlength=256)
    expected = drawn.size / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 5 * np.sqrt(2 * 255)  # chi-square with 255 dof: mean 255, sd 22.6


def test_corruption_is_a_pure_function_of_the_key():
    tokens, valid = make_rows(0)
    a = corrupt(jax.random.key(7), tokens, valid)
    b = corrupt(jax.random.key(7), tokens, valid)
    c = corrupt(jax.random.key(8), tokens, valid)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert np.any(a["weights"] != c["weights"]) and np.any(a["inputs"] != c["inputs"])
    # Inside a user's own jit and vmap it is the same function.
    keys = jax.random.split(jax.random.key(7), 2)
    vmapped = jax.jit(jax.vmap(lambda k: mask_tokens(
        k, tokens, mask_id=MASK, special_ids=SPECIAL, vocab_size=TOK.vocab_size,
        valid_BT=valid)["inputs"]))(keys)
    np.testing.assert_array_equal(vmapped[0], corrupt(keys[0], tokens, valid)["inputs"])


def test_mask_batch_skips_padding_segments_and_passes_other_keys():
    tokens = np.full((2, 8), ord("x"), np.int32)
    segments = np.array([[1] * 8, [1] * 4 + [0] * 4], np.int32)
    out = mask_batch(jax.random.key(0), {"inputs": tokens, "segment_ids": segments}, TOK,
                     MaskingConfig(rate=1.0))
    np.testing.assert_array_equal(out["weights"], segments.astype(np.float32))
    np.testing.assert_array_equal(out["segment_ids"], segments)


@pytest.mark.parametrize(
    "bad",
    [dict(rate=0.0), dict(rate=1.5), dict(mask_fraction=0.9, random_fraction=0.2),
     dict(random_fraction=-0.1)],
)
def test_masking_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="masking"):
        MaskingConfig(**bad)


def test_mlm_batch_frames_rows_and_is_pure_in_seed_and_index():
    corpus = TOK.encode("the quick brown fox jumps over the lazy dog. " * 20)
    a = mlm_batch(corpus, 8, 32, seed=3, index=5)
    b = mlm_batch(corpus, 8, 32, seed=3, index=5)
    c = mlm_batch(corpus, 8, 32, seed=3, index=6)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert np.any(a["targets"] != c["targets"])
    assert a["inputs"].shape == a["token_types"].shape == (8, 32)
    assert np.all(a["targets"][:, 0] == TOK.special["cls"])
    assert np.all(a["targets"][:, -1] == TOK.special["sep"])
    assert np.all(a["weights"][:, [0, -1]] == 0)  # [CLS] and [SEP] are never chosen
    assert np.all(a["weights"].sum(-1) == 4)  # round(0.15 * 30)


def test_mlm_loss_only_on_chosen_positions():
    cfg = ModelConfig(family="bert", vocab_size=TOK.vocab_size, d_model=32, n_layers=1,
                      n_heads=2, mask="bidirectional", position="rope")
    model = build_model(cfg)
    corpus = TOK.encode("abcdefghij" * 20)
    batch = {k: jnp.asarray(v) for k, v in mlm_batch(corpus, 4, 16, 0, 0).items()}
    objective = objective_for("bert")
    # compiled once (params and batch as arguments) and called three times: cheaper than
    # running the model op by op
    params = jax.jit(lambda key, b: objective.init_params(model, key, b))(jax.random.key(0), batch)
    objective_of = jax.jit(lambda p, b: mlm_objective(model, p, b))
    loss, metrics = objective_of(params, batch)
    assert float(metrics["tokens"]) == float(batch["weights"].sum()) > 0
    # A different target where nothing was chosen changes nothing; at a chosen one it does.
    unchosen = batch["weights"] == 0
    moved = {**batch, "targets": jnp.where(unchosen, (batch["targets"] + 1) % 256,
                                           batch["targets"])}
    np.testing.assert_allclose(objective_of(params, moved)[0], loss, rtol=1e-6)
    chosen = {**batch, "targets": jnp.where(unchosen, batch["targets"],
                                            (batch["targets"] + 1) % 256)}
    assert abs(float(objective_of(params, chosen)[0]) - float(loss)) > 1e-4


def test_masked_batches_over_the_text_pipeline_resume_exactly():
    from transformers_jax.data.mlm_batches import MaskedBatches, mask_eval_batches
    from transformers_jax.data.pipeline import make_lm_iterator

    docs = ["the cat sat on the mat. " * 3, "a dog. ", "birds fly south in winter. " * 2]

    def batches():
        return MaskedBatches(make_lm_iterator(docs, TOK, 24, 4, seed=0, pack=True), 5, TOK)

    it = batches()
    first = [next(it) for _ in range(2)]
    state = it.get_state()
    after = [next(it) for _ in range(2)]
    resumed = batches()
    resumed.set_state(state)
    for a, b in zip(after, [next(resumed) for _ in range(2)], strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for batch in first + after:
        chosen = batch["weights"] > 0
        assert not np.any(chosen & (batch["segment_ids"] == 0))
        assert not np.any(chosen & np.isin(batch["targets"], SPECIAL))  # bos/eos/pad never
        np.testing.assert_array_equal(batch["inputs"][~chosen], batch["targets"][~chosen])
        assert chosen.sum() > 0 and "positions" in batch
    fixed = mask_eval_batches(first, 5, TOK)
    np.testing.assert_array_equal(fixed[0]["inputs"], mask_eval_batches(first, 5, TOK)[0]["inputs"])
    assert np.any(fixed[0]["weights"] != first[0]["weights"])  # its own key stream
