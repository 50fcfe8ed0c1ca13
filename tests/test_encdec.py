"""The encoder-decoder family: masks, cross-attention, positions, decoding, and learning."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from family_fixtures import jit_optimised
from model_helpers import POSITIONS, assert_attention_implementations_agree

from transformers_jax import ModelConfig, build_model
from transformers_jax.data import seq2seq
from transformers_jax.data.prefix_lm import prefix_lm_batch
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.evaluation import seq2seq_exact_match
from transformers_jax.learning import objectives as O
from transformers_jax.learning.losses import sequence_accuracy
from transformers_jax.learning.step import init_state, make_train_step
from transformers_jax.models.encdec import EncoderDecoder
from transformers_jax.models.family import GPT_INPUTS

TOK = ByteTokenizer()
S, T = 9, 7


def tiny(**changes) -> ModelConfig:
    base = dict(family="encdec", vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_len=32)
    return ModelConfig(**{**base, **changes})


def init(cfg, seed=0, **inputs):
    model = build_model(cfg)
    dec = jax.random.randint(jax.random.key(seed + 1), (2, T), 0, cfg.vocab_size)
    enc = jax.random.randint(jax.random.key(seed + 2), (2, S), 0, cfg.vocab_size)
    # compiled as one program: run op by op, init compiles each operation of its own
    variables = jax.jit(lambda key: model.init(key, dec, encoder_inputs=enc, **inputs))(
        jax.random.key(seed))
    return model, nn.meta.unbox(variables["params"]), dec, enc


def jacobians(model, params, dec, enc, queries, **inputs):
    """For each decoder position in ``queries``: d(sum of its logits) / d(decoder and encoder
    embeddings): one compiled backward pass, run once per query."""
    perturbations = jax.jit(lambda key: model.init(key, dec, encoder_inputs=enc, **inputs))(
        jax.random.key(0))["perturbations"]

    @jax.jit
    def pulled_back(p, cotangent):
        logits, pullback = jax.vjp(lambda p: model.apply(
            {"params": params, "perturbations": p}, dec, encoder_inputs=enc, **inputs), p)
        return pullback(cotangent)[0]

    logits = jax.eval_shape(lambda: model.apply({"params": params}, dec, encoder_inputs=enc,
                                                **inputs))
    for query in queries:
        cotangent = jnp.zeros(logits.shape, logits.dtype).at[:, query].set(1.0)
        grads = pulled_back(perturbations, cotangent)
        yield np.asarray(grads["decoder_embeddings"]), np.asarray(grads["encoder_embeddings"])


@functools.cache
def scheme(position: str):
    """(model, params, dec, enc) of ``tiny(position=position, init_std=0.2, n_layers=1)``,
    built once and shared by the per-scheme tests below. One layer a stack: what a mask or a
    scheme lets through, one layer already shows (a second applies the same mask again, and
    the stack's shared parts have tests of their own: the t5 bias, ``test_block_options``);
    it halves the compiles of 20 backward passes."""
    return init(tiny(position=position, init_std=0.2, n_layers=1))


# Each scheme's properties against the reference run in the quick tier for t5 (this family's
# bias scheme); every scheme's are also checked on the decoder-only model (tests/test_gpt.py).
QUICK_POSITIONS = ("t5",)
POSITION_CASES = [p if p in QUICK_POSITIONS else pytest.param(p, marks=pytest.mark.slow)
                  for p in POSITIONS]


@pytest.mark.parametrize("position", POSITION_CASES)
def test_decoder_never_sees_later_targets_and_sees_the_whole_source(position):
    model, params, dec, enc = scheme(position)
    enc_segments = jnp.array([[1] * S, [1] * 6 + [0] * 3])  # row 1: 3 padding tokens
    queries = (0, T - 2)
    for query, (g_dec, g_enc) in zip(queries, jacobians(
            model, params, dec, enc, queries, encoder_segment_ids=enc_segments), strict=True):
        assert np.all(g_dec[:, query + 1 :] == 0.0), "a later target reached the output"
        assert np.all(np.abs(g_dec[:, : query + 1]).sum(-1) > 0), "earlier targets should matter"
        assert np.all(np.abs(g_enc[0]).sum(-1) > 0), "every source token should matter"
        assert np.all(np.abs(g_enc[1, :6]).sum(-1) > 0)
        assert np.all(g_enc[1, 6:] == 0.0), "encoder padding reached the decoder"


@pytest.mark.parametrize("position", POSITION_CASES)
def test_forward_deterministic_and_appended_padding_changes_nothing(position):
    model, params, dec, enc = scheme(position)
    apply = jax.jit(model.apply)  # one program a shape, not one per operation
    ones = lambda x: jnp.ones(x.shape, jnp.int32)  # noqa: E731
    real = apply({"params": params}, dec, encoder_inputs=enc, segment_ids=ones(dec),
                 encoder_segment_ids=ones(enc))
    assert real.shape == (2, T, 64) and real.dtype == jnp.float32
    assert np.isfinite(np.asarray(real)).all()
    np.testing.assert_array_equal(real, apply({"params": params}, dec, encoder_inputs=enc,
                                              segment_ids=ones(dec),
                                              encoder_segment_ids=ones(enc)))
    pad = lambda x, n: jnp.concatenate([x, jnp.full((2, n), 5, x.dtype)], 1)  # noqa: E731
    seg = lambda x, n: jnp.concatenate([ones(x), jnp.zeros((2, n), jnp.int32)], 1)  # noqa: E731
    out = apply({"params": params}, pad(dec, 4), encoder_inputs=pad(enc, 5),
                segment_ids=seg(dec, 4), encoder_segment_ids=seg(enc, 5))
    np.testing.assert_allclose(out[:, :T], real, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_encode_then_decode_equals_the_full_call_and_packed_segments_stay_apart():
    model, params, dec, enc = init(tiny(position="t5"))
    v = {"params": params}
    enc_seg = jnp.array([[1] * 5 + [2] * 4] * 2)
    dec_seg = jnp.array([[1] * 4 + [2] * 3] * 2)
    kw = dict(segment_ids=dec_seg, encoder_segment_ids=enc_seg)
    full = model.apply(v, dec, encoder_inputs=enc, **kw)
    encoded = model.apply(v, enc, encoder_segment_ids=enc_seg, method=EncoderDecoder.encode)
    assert encoded.shape == (2, S, 32)
    np.testing.assert_allclose(model.apply(v, dec, encoded, method=EncoderDecoder.decode, **kw),
                               full, atol=1e-6)
    # Decoder segment 1 reads only encoder segment 1, and the reverse.
    (_, g_enc), (g_dec_5, g_enc_5) = jacobians(model, params, dec, enc, (2, 5), **kw)
    assert np.all(g_enc[:, 5:] == 0.0) and np.all(np.abs(g_enc[:, :5]).sum(-1) > 0)
    g_dec, g_enc = g_dec_5, g_enc_5
    assert np.all(g_enc[:, :5] == 0.0) and np.all(g_dec[:, :4] == 0.0)


@pytest.mark.parametrize("position", [pytest.param("rope", marks=pytest.mark.slow), "t5",
                                      pytest.param("alibi", marks=pytest.mark.slow),
                                      pytest.param("fire", marks=pytest.mark.slow)])
def test_cross_attention_carries_no_position_term(position):
    """Relative schemes only: shifting every encoder position by the same amount leaves the
    encoder output unchanged, so the logits change only if cross-attention used positions."""
    model, params, dec, enc = scheme(position)
    base = jnp.broadcast_to(jnp.arange(S), (2, S))
    a = model.apply({"params": params}, dec, encoder_inputs=enc, encoder_positions=base)
    b = model.apply({"params": params}, dec, encoder_inputs=enc, encoder_positions=base + 11)
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_t5_bias_is_computed_once_per_stack_and_not_in_cross_attention():
    _, params, _, _ = init(tiny(position="t5", n_layers=3))
    for stack in ("encoder", "decoder"):
        assert params[stack]["relative_bias"]["rel_embedding"].shape == (32, 4)
        assert all("relative_bias" not in params[stack][f"layer_{i}"] for i in range(3))
    assert set(params["decoder"]["layer_0"]) == {
        "attention", "cross_attention", "mlp", "norm1", "norm_cross", "norm2"}


# in the full suite only: the quick tier checks every kernel through the decoder-only model
# with t5's bias gradient (tests/test_gpt.py)
@pytest.mark.slow
@pytest.mark.parametrize("position", ["rope", "t5"])
def test_every_attention_implementation_gives_the_same_model(position):
    """Same logits through every implementation; same gradients too with a bias scheme (the
    bias gradient is the extra path the kernels must get right)."""
    enc_seg = jnp.array([[1] * S, [1] * 6 + [0] * 3])
    dec_seg = jnp.array([[1] * T, [1] * 5 + [0] * 2])
    kw = dict(segment_ids=dec_seg, encoder_segment_ids=enc_seg)

    def loss_for(cfg):
        model, params, dec, enc = init(cfg)

        def loss(p):
            out = model.apply({"params": p}, dec, encoder_inputs=enc, **kw)
            return (out[:, :5] ** 2).mean(), out

        return loss, params

    assert_attention_implementations_agree(tiny, position, loss_for)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        dict(norm_position="post", mlp="relu", tie_embeddings=False),
        dict(n_kv_heads=1, mlp="swiglu", norm="rmsnorm", use_bias=False, position="t5",
             attention_scale=1.0),
        dict(mask={"name": "sliding_window", "window": 3}),
        dict(dropout=0.1, qk_norm=True),
    ],
)
def test_block_options(changes):
    cfg = tiny(**changes)
    model, params, dec, enc = init(cfg)
    logits = model.apply({"params": params}, dec, encoder_inputs=enc)
    assert np.isfinite(np.asarray(logits)).all()
    if not cfg.tie_embeddings:
        assert params["lm_head"]["kernel"].shape == (32, 64)
    if cfg.dropout:
        dropped = model.apply({"params": params}, dec, encoder_inputs=enc, deterministic=False,
                              rngs={"dropout": jax.random.key(1)})
        assert np.abs(np.asarray(dropped - logits)).max() > 1e-4


def test_bidirectional_decoder_mask_is_refused():
    with pytest.raises(ValueError, match="must not see later targets"):
        init(tiny(mask="bidirectional"))


def test_seq2seq_batches_follow_the_contract():
    batch = seq2seq.seq2seq_batch("reverse", 4, seed=0, index=3, max_size=5)
    again = seq2seq.seq2seq_batch("reverse", 4, seed=0, index=3, max_size=5)
    for k in batch:
        np.testing.assert_array_equal(batch[k], again[k])
    sp = TOK.special
    assert batch["encoder_inputs"].shape == (4, 6) and batch["inputs"].shape == (4, 6)
    for i in range(4):
        n = int(batch["encoder_segment_ids"][i].sum()) - 1
        src = batch["encoder_inputs"][i, :n]
        assert batch["encoder_inputs"][i, n] == sp["eos"]
        np.testing.assert_array_equal(batch["targets"][i, :n], src[::-1])
        assert batch["targets"][i, n] == sp["eos"] and batch["inputs"][i, 0] == sp["bos"]
        np.testing.assert_array_equal(batch["inputs"][i, 1 : n + 1], batch["targets"][i, :n])
        assert batch["weights"][i].sum() == n + 1
    src, tgt = seq2seq.task_pairs("addition", [3], seed=0)[0]
    a, b = TOK.decode(src).split("+")
    assert int(TOK.decode(tgt)) == int(a) + int(b) and len(a) == len(b) == 3


@pytest.mark.slow
def test_pipeline_task_batches_feed_the_seq2seq_objective():
    """The data pipeline's encoder-decoder batches (``--task``) fit the model and objective."""
    from transformers_jax.data.pipeline import make_task_iterator

    batch = next(make_task_iterator("reverse", TOK, 12, 4, fmt="encdec", train_lengths=(1, 5)))
    cfg = tiny(vocab_size=TOK.vocab_size, n_layers=1, position="t5")
    model = build_model(cfg)
    objective = O.objective_for("encdec")
    params = objective.init_params(model, jax.random.key(0), batch)
    loss, metrics = objective.loss(model, params, batch, None, True)
    assert np.isfinite(float(loss)) and float(metrics["tokens"]) == batch["weights"].sum()


# Learning ----------------------------------------------------------------------------------------


def fit(cfg, objective, batch_at, steps, lr=3e-3):
    model = build_model(cfg)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 50, steps, lr / 30)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    # init as one program (op by op it compiles each operation: ~1 s more)
    state = jax.jit(lambda batch: init_state(model, optimizer, 0, batch, objective))(batch_at(0))
    # XLA's full optimisation halves a step (15 -> 30 ms) for ~6 s more compile (2-core CPU):
    # it pays from about 400 steps on
    jit = jit_optimised if steps > 400 else jax.jit
    step = jit(make_train_step(model, optimizer, objective=objective))
    for i in range(steps):
        state, _ = step(state, batch_at(i))
    return model, state.params


# task: (position scheme, largest training size, steps, peak learning rate, required exact
# match). Copy needs absolute positions (output i reads source token i); t5 bias alone learns
# it much more slowly. Fewest steps with a margin (greedy exact match, smallest over the
# trained sizes): reverse 0.31 at 250 steps, 0.98 at 400 (at 6e-3: 0.84 at 300); copy 1.0 at
# 150, 250 and 400 steps; addition at 3e-3 0.55 at 700, 0.95 at 1000, 1.0 at 1500, at 6e-3
# 0.97 at 900 (62 of 64 two-digit sums).
SEQ2SEQ_CASES = {
    "reverse": ("t5", 6, 400, 3e-3, 0.9),
    "copy": ("learned", 6, 200, 3e-3, 0.9),
    "addition": ("t5", 2, 900, 6e-3, 0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("task", list(SEQ2SEQ_CASES))
def test_encoder_decoder_learns_synthetic_tasks(task):
    position, max_size, steps, lr, required = SEQ2SEQ_CASES[task]
    cfg = tiny(vocab_size=TOK.vocab_size, d_model=64, n_layers=1, position=position)
    model, params = fit(cfg, O.objective_for("encdec"),
                        lambda i: seq2seq.seq2seq_batch(task, 64, 0, i, max_size=max_size), steps,
                        lr=lr)
    sizes = list(range(1, max_size + 1))  # the trained sizes (longer ones are not asserted)
    accuracy = seq2seq_exact_match(model, params, task, sizes, n_per_size=64)
    print(f"\n{task}: greedy exact match by size (trained on 1-{max_size}): {accuracy}")
    assert all(accuracy[n] >= required for n in sizes), accuracy
    # Greedy exact match equals the teacher-forced sequence accuracy on the same examples.
    pairs = seq2seq.task_pairs(task, [max_size] * 64, seed=1234 + 1000 * max_size)
    batch = seq2seq.pack_seq2seq(pairs, *seq2seq.task_shapes(task, max_size))
    _, metrics = jax.jit(lambda p, b: O.seq2seq_objective(model, p, b))(params, batch)
    np.testing.assert_allclose(float(metrics["sequence_accuracy"]), accuracy[max_size])


@pytest.mark.slow
def test_prefix_lm_learns_a_conditional_task_with_loss_after_the_prefix():
    """Decoder-only comparison: GPT with mask=prefix on ``[bos] letters [sep] reversed [eos]``."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=64, n_layers=1, n_heads=4,
                      mask="prefix", position="learned", max_len=16)

    def batch_at(i, seed=0, n=64):
        rng = np.random.default_rng([seed, i])
        pairs = seq2seq.task_pairs("reverse", rng.integers(1, 5, size=n), seed=seed * 100_000 + i)
        return prefix_lm_batch(pairs, 11)

    batch = batch_at(0)
    src_end = batch["prefix_len"][0]
    assert np.all(batch["weights"][0, : src_end - 1] == 0)  # no loss inside the prefix
    assert batch["weights"][0].sum() == src_end - 1  # the reversed letters and eos
    model, params = fit(cfg, O.objective_for("gpt"), batch_at, 400)
    held_out = batch_at(0, seed=1, n=256)
    _, metrics = jax.jit(lambda p, b: O.lm_objective(model, p, b))(params, held_out)
    accuracy = float(jax.jit(lambda p, b: sequence_accuracy(
        O.apply_model(model, p, b, GPT_INPUTS), b["targets"], b["weights"]))(params, held_out))
    print(f"\nprefix-LM reverse: token accuracy {float(metrics['accuracy']):.3f}, "
          f"sequence accuracy {accuracy:.3f}")
    assert accuracy >= 0.9
