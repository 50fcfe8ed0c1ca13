"""Context usage as a sweep evaluation: the perturbations (only the far context changes, each
as it says), windows drawn alike for every cell and seed, the spec's keys and metrics, and a
tiny sweep of a GPT and an LSTM scored and compared on the same perturbed windows."""

from __future__ import annotations

import numpy as np
import pytest

from transformers_jax.sweep.context import (
    PERTURBATIONS,
    Far,
    Sources,
    draw_windows,
    perturb,
    rng_for,
)

EOS = 1
VOCAB = 50


def _sources(n_docs: int = 6, doc_len: int = 40) -> Sources:
    """Held-out documents of random ids 10-49, each ended by eos, and training tokens that
    use only the ids 2-5 (3 twice as often as the others)."""
    rng = np.random.default_rng(0)
    docs = [np.r_[rng.integers(10, VOCAB, doc_len - 1), EOS] for _ in range(n_docs)]
    heldout_N = np.concatenate(docs).astype(np.int32)
    train_N = np.array([2, 3, 3, 4, 5] * 100, np.int32)
    return Sources.of(train_N, heldout_N, EOS, VOCAB)


def _window(n: int = 41) -> np.ndarray:
    return np.arange(100, 100 + n, dtype=np.int32)


@pytest.mark.parametrize("name", PERTURBATIONS.names())
def test_only_the_far_context_changes_and_the_same_seed_draws_the_same(name):
    sources = _sources()
    w_T = _window()
    first, b = 36, 10  # the targets are w_T[36:], the near context w_T[26:36]
    where = Far(80, 80 + len(w_T), sources, span=4)
    out = perturb(name, w_T, first, b, rng_for(0, name, b), where)
    cut = first - b
    keep = len(w_T) - cut
    np.testing.assert_array_equal(out[-keep:], w_T[cut:])  # near context and targets as they were
    again = perturb(name, w_T, first, b, rng_for(0, name, b), where)
    np.testing.assert_array_equal(out, again)
    if name != "truncate":
        assert len(out) == len(w_T) and not np.array_equal(out[:cut], w_T[:cut])
        other = perturb(name, w_T, first, b, rng_for(1, name, b), where)
        assert not np.array_equal(out, other)  # another seed, another draw


def test_truncate_keeps_exactly_the_b_nearest_context_tokens():
    w_T = _window()
    out = perturb("truncate", w_T, 36, 10, rng_for(0, "truncate", 10), Far(0, 41, _sources(), 4))
    np.testing.assert_array_equal(out, w_T[26:])
    assert len(out) == 10 + 5  # b context tokens, then the 5 tokens from the first target on


def test_shuffles_permute_the_far_context_and_the_local_one_within_spans():
    w_T = _window()
    where = Far(0, 41, _sources(), span=4)
    cut = 26
    out = perturb("shuffle", w_T, 36, 10, rng_for(0, "shuffle", 10), where)
    assert sorted(out[:cut]) == list(w_T[:cut])
    local = perturb("shuffle_local", w_T, 36, 10, rng_for(0, "shuffle_local", 10), where)
    # spans of 4 counted back from the boundary: [22, 26), [18, 22), ..., [2, 6), [0, 2)
    for stop in range(cut, 0, -4):
        lo = max(stop - 4, 0)
        assert sorted(local[lo:stop]) == list(w_T[lo:stop])
    assert not np.array_equal(local[:cut], w_T[:cut])


def test_unigram_replacements_follow_the_training_tokens():
    sources = _sources()
    w_T = _window(401)
    out = perturb(
        "replace_unigram", w_T, 396, 5, rng_for(0, "replace_unigram", 5), Far(0, 401, sources, 4)
    )
    drawn = out[:391]
    assert set(drawn.tolist()) <= {2, 3, 4, 5}  # ids never seen in training are never drawn
    share = np.mean(drawn == 3)
    assert 0.3 < share < 0.5  # 3 is 2 in 5 of the training tokens


def test_elsewhere_takes_consecutive_text_of_documents_the_window_does_not_touch():
    sources = _sources(n_docs=6, doc_len=40)
    heldout_N = sources.heldout_N
    start, stop = 70, 111  # the window spans documents 1 and 2 (positions 40-119)
    touched = set(sources.document_N[start:stop].tolist())
    assert touched == {1, 2}
    for seed in range(20):
        span = sources.elsewhere(30, start, stop, np.random.default_rng(seed))
        at = [i for i in range(len(heldout_N) - 29) if np.array_equal(heldout_N[i : i + 30], span)]
        assert at and all(not touched & set(sources.document_N[i : i + 30].tolist()) for i in at)
    with pytest.raises(ValueError, match="hold out more text"):
        sources.elsewhere(150, start, stop, np.random.default_rng(0))


def test_windows_are_drawn_alike_whatever_else_the_spec_lists():
    sources = _sources(n_docs=10)
    one = draw_windows(sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=3, span=4)
    two = draw_windows(sources, 40, 4, [20], ["truncate", "shuffle"], 30, seed=3, span=4)
    np.testing.assert_array_equal(one.intact_WT, two.intact_WT)
    np.testing.assert_array_equal(one.perturbed[("shuffle", 20)], two.perturbed[("shuffle", 20)])
    assert one.intact_WT.shape == (30, 41) and len(set(one.starts_W.tolist())) == 30
    assert one.perturbed[("truncate", 5)].shape == (30, 5 + 4)
    assert (
        one.digest()
        == draw_windows(
            sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=3, span=4
        ).digest()
    )
    assert (
        one.digest()
        != draw_windows(
            sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=4, span=4
        ).digest()
    )
    with pytest.raises(ValueError, match="fewer than the 500"):
        draw_windows(sources, 40, 4, [5], ["shuffle"], 500, seed=0, span=4)
