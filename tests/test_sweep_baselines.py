"""Each seed's n-gram baselines are fitted on the tokens its run read: what ``seed_text``
reads for a run equals, token for token, what training drew for that run."""

import dataclasses

import numpy as np
import pytest

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.sweep.seed_text import row_tokens, run_tokens


class Recorder:
    """A training iterator that keeps every batch it hands out."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.seen.append(batch)
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def test_row_tokens_are_the_first_input_and_the_targets_that_count():
    batch = {"inputs": np.array([[5, 6, 7], [1, 2, 0]]), "targets": np.array([[6, 7, 8],
                                                                               [2, 9, 0]]),
             "weights": np.array([[1, 1, 1], [1, 1, 0]])}
    assert [r.tolist() for r in row_tokens(batch)] == [[5, 6, 7, 8], [1, 2, 9]]


@pytest.mark.slow
def test_a_runs_tokens_are_the_batches_training_drew(tmp_path, monkeypatch):
    from transformers_jax.train import setup
    from transformers_jax.train.loop import train

    text = tmp_path / "text.txt"
    text.write_text("".join(f"document {i}: {'abcdefgh'[i % 8] * (20 + i)}\n"
                            for i in range(60)))
    model_cfg = ModelConfig(vocab_size=262, d_model=16, n_layers=1, n_heads=2, max_len=16)
    cfg = TrainConfig(data=f"lines:{text}", data_dir=str(tmp_path / "prepared"), seq_len=16,
                      batch_size=2, steps=6, seed=3,
                      eval_every=1000, log_every=1000, progress=False)
    seen: list = []
    real = setup.make_run_data
    monkeypatch.setattr(setup, "make_run_data", lambda *a, **k: dataclasses.replace(
        real(*a, **k), train=Recorder(real(*a, **k).train, seen)))
    train(model_cfg, cfg)
    drawn = np.concatenate([row for batch in seen for row in row_tokens(batch)])
    read = run_tokens(model_cfg, cfg, ByteTokenizer())
    assert len(seen) == cfg.steps and np.array_equal(read, drawn)
    other = run_tokens(model_cfg, cfg.replace(seed=4), ByteTokenizer())
    assert not np.array_equal(other, drawn)  # another seed reads other rows
