"""The LSTM baseline: causal, and it learns from context at the transformer's default budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import ModelConfig, TrainConfig, build_model
from transformers_jax.data.corpus import default_corpus
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.learning.optim import make_optimizer
from transformers_jax.learning.step import init_state, make_train_step
from transformers_jax.registry import FAMILIES


def test_lstm_is_causal():
    model = build_model(ModelConfig(family="lstm", vocab_size=64, d_model=32, n_layers=2))
    tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 64)
    variables = model.init(jax.random.key(1), tokens)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % 64)
    delta = jnp.abs(model.apply(variables, tokens) - model.apply(variables, changed)).max((0, 2))
    assert float(delta[:6].max()) == 0.0  # earlier outputs never see a later token
    assert float(delta[6:].min()) > 0.0  # later outputs do


@pytest.mark.parametrize("family", FAMILIES.names())
def test_recurrent_families_are_the_ones_without_attention(family):
    """``Family.recurrent`` (how a caller tells the recurrent baseline from the transformers)
    holds exactly for the families whose parameters hold no attention."""
    cfg = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=1, n_heads=2)
    entry = FAMILIES.get(family)
    tokens, kwargs = entry.example_inputs(cfg)
    params = entry.build(cfg).init(jax.random.key(0), tokens, **kwargs)["params"]
    paths = ["/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert entry.recurrent == (not any("attention" in p for p in paths)), paths


@pytest.mark.slow
def test_lstm_uses_context_within_a_short_default_run():
    # Regression: with the transformer's 0.02 embedding init the LSTM sat at the unigram loss
    # (3.2 nats/byte here) for hundreds of steps; with unit-variance embeddings it learns bigrams
    # and beyond within 200 steps of the default optimiser.
    tok = ByteTokenizer()
    text = np.asarray(tok.encode(default_corpus()[:200_000]), np.int32)
    counts = np.bincount(text, minlength=tok.vocab_size) / len(text)
    unigram = float(-(counts[counts > 0] * np.log(counts[counts > 0])).sum())
    model = build_model(ModelConfig(family="lstm", vocab_size=tok.vocab_size, d_model=64,
                                    n_layers=1))
    train_cfg = TrainConfig(steps=200, batch_size=16, seq_len=64)
    optimizer = make_optimizer(train_cfg)
    rng = np.random.default_rng(0)

    def batch():
        starts = rng.integers(0, len(text) - 65, size=16)
        rows = np.stack([text[s : s + 65] for s in starts])
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    state = init_state(model, optimizer, 0, batch())
    step = jax.jit(make_train_step(model, optimizer))
    losses = []
    for _ in range(train_cfg.steps):
        state, metrics = step(state, batch())
        losses.append(float(metrics["loss"]))
    final = float(np.mean(losses[-10:]))
    print("unigram", unigram, "final", final)
    assert final < unigram - 0.6, (unigram, final)


def test_sampling_an_lstm_run_is_refused_before_anything_is_printed(tmp_path, capsys):
    """`tjax sample` on an LSTM run: one error line naming the families that generate, and no
    prompt echoed first (it once printed a seq2seq model's ``source: ... =>``)."""
    from transformers_jax.cli import main
    from transformers_jax.train.loop import train

    run = str(tmp_path / "lstm")
    train(ModelConfig(family="lstm", vocab_size=262, d_model=16, n_layers=1),
          TrainConfig(steps=1, batch_size=2, seq_len=16, eval_batches=1, run_dir=run,
                      progress=False, tensorboard=False))
    capsys.readouterr()
    assert main(["sample", "--run", run, "--prompt", "The"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == ("tjax sample: error: family='lstm' cannot generate with a KV cache; "
                           "sampling is for encdec, gpt models")
