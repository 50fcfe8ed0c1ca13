"""The Kneser-Ney baseline: probabilities worked by hand, normalisation, and sanity on text."""

import numpy as np
import pytest

from transformers_jax.study.ngram import KneserNey, ngram_losses


def test_bigram_kneser_ney_matches_hand_values():
    # corpus 0 1 0 1 2 0 (V=3). Continuation counts N1+(. w): 0 <- {1, 2}: 2; 1 <- {0}: 1;
    # 2 <- {1}: 1; total 4; D1 = n1/(n1+2 n2) = 2/(2+2) = 0.5, so
    # P1(0) = 1.5/4 + 0.5*3/4*1/3 = 0.5, P1(1) = P1(2) = 0.5/4 + 0.125 = 0.25.
    # Bigram counts: 01 x2, 10, 12, 20 -> D2 = 3/(3+2) = 0.6.
    # P(1|0) = 1.4/2 + 0.6*1/2*0.25 = 0.775; P(0|0) = 0.3*0.5 = 0.15; P(2|0) = 0.075.
    # P(0|1) = 0.4/2 + 0.6*2/2*0.5 = 0.5; P(2|1) = 0.2 + 0.6*0.25 = 0.35; P(1|1) = 0.15.
    # P(0|2) = 0.4 + 0.6*0.5 = 0.7; P(1|2) = P(2|2) = 0.15.
    m = KneserNey(2, 3).fit(np.array([0, 1, 0, 1, 2, 0]))
    assert m.discounts == pytest.approx([0.5, 0.6])
    want = {0: [0.15, 0.775, 0.075], 1: [0.5, 0.15, 0.35], 2: [0.7, 0.15, 0.15]}
    for c, probs in want.items():
        got = m.next_probs(np.full((3, 1), c), np.arange(3))
        np.testing.assert_allclose(got, probs, rtol=1e-12)
    # no context (stream start): the continuation unigram
    np.testing.assert_allclose(m.next_probs(np.full((3, 1), -1), np.arange(3)), [0.5, .25, .25])
    # token_losses scores positions 1.. with the previous token as context
    np.testing.assert_allclose(m.token_losses(np.array([0, 1, 2])), -np.log([0.775, 0.35]))


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_every_context_sums_to_one_over_the_vocabulary(order):
    rng = np.random.default_rng(order)
    V = 9
    m = KneserNey(order, V).fit(rng.integers(0, 6, 400))  # tokens 6-8 never seen
    contexts = rng.integers(-1, V, (40, 4))
    contexts[:5] = np.tile(np.array([0, 1, 2, 3]), (5, 1))  # seen ones too
    P = np.stack([m.next_probs(contexts, np.full(40, w)) for w in range(V)], axis=1)
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
    assert (P > 0).all()


def test_higher_orders_fit_a_repetitive_stream():
    rng = np.random.default_rng(0)
    phrase = np.array([0, 1, 0, 2, 0, 3, 0, 4])  # after 0 the bigram cannot tell; 3-gram can
    stream = np.concatenate([phrase if rng.random() < 0.8 else rng.integers(0, 20, 8)
                             for _ in range(300)])
    losses = ngram_losses(stream[:1500], stream[1500:], 20, orders=(1, 2, 3, 5))
    assert losses["1-gram"] > losses["2-gram"] > losses["3-gram"] > losses["5-gram"]
    assert losses["5-gram"] < 0.7 * losses["2-gram"]
