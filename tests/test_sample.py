"""Sampling: filters keep exactly the allowed set, greedy is stable, batches and stops work.

Tiny models are initialised once per config (``built``: eagerly, as their shapes' operations
are compiled already by the first); the tests that compile a decoder of their own are left out
of the quick tier (``slow``), CI runs them all.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import apply
from model_helpers import init, tiny

from transformers_jax import sample
from transformers_jax.config import ConfigError
from transformers_jax.sample import (
    SamplingConfig,
    cache_bytes,
    check_cache_fits,
    filter_logits,
    generate,
)

built = functools.cache(init)  # (model, params, tokens) once per config


def test_top_k_keeps_exactly_k():
    logits = jnp.array([[0.1, 3.0, 2.0, -1.0, 2.5]])
    kept = np.asarray(filter_logits(logits, top_k=2, top_p=None)) > -1e29
    np.testing.assert_array_equal(kept[0], [False, True, False, False, True])


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(probs))[None, ::-1]  # shuffled order: [0.05, 0.15, 0.3, 0.5]
    kept = np.asarray(filter_logits(logits, top_k=None, top_p=0.8)) > -1e29
    np.testing.assert_array_equal(kept[0], [False, False, True, True])  # 0.5 + 0.3 reach 0.8
    kept = np.asarray(filter_logits(logits, top_k=None, top_p=0.81)) > -1e29
    np.testing.assert_array_equal(kept[0], [False, True, True, True])
    kept = np.asarray(filter_logits(logits, top_k=None, top_p=0.1)) > -1e29
    np.testing.assert_array_equal(kept[0], [False, False, False, True])  # top token always kept


def test_filters_take_traced_settings_and_none_keeps_every_token():
    """The settings may be traced values (what the compiled decoder passes): the same sets as
    with Python numbers, and 0 / 1 (no top-k / no nucleus) keep every token."""
    logits = jnp.array([[0.1, 3.0, 2.0, -1.0, 2.5]])
    traced = jax.jit(filter_logits)
    for top_k, top_p in [(2, 1.0), (0, 0.5), (3, 0.9), (0, 1.0), (9, 1.0)]:
        python = filter_logits(logits, top_k or None, top_p if top_p < 1 else None)
        np.testing.assert_array_equal(np.asarray(traced(logits, top_k, top_p)),
                                      np.asarray(python))
    np.testing.assert_array_equal(np.asarray(traced(logits, 0, 1.0)), np.asarray(logits))


def test_new_sampling_settings_run_the_program_already_compiled():
    """Temperature, top-k and top-p reach the decoder as values: once greedy decoding (its
    own program) and one sampling call have run, another temperature, a top-k and a nucleus
    lower nothing more (a lowering is counted whether XLA then compiles it or finds it in the
    persistent cache), and each setting still acts (top_k=1 equals greedy)."""
    cfg = tiny(init_std=0.5)
    model, params, _ = init(cfg)
    lowerings = []

    def count(event, *args, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowerings.append(event)

    def run(**settings):
        return generate(model, params, [[1, 2, 3]],
                        SamplingConfig(max_new_tokens=5, **settings), seed=3)

    greedy = run(temperature=0.0)
    run(temperature=1.0)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        assert run(temperature=0.0) == greedy
        hot = run(temperature=2.5)
        top1 = run(temperature=0.7, top_k=1)
        run(temperature=1.3, top_p=0.5)
        run(temperature=0.9, top_k=4, top_p=0.9)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert lowerings == []
    assert top1 == greedy and hot != greedy


def test_sampled_tokens_stay_inside_the_allowed_set():
    """The first sampled token of 20 draws (top-k 3, hot) is always among the 3 most likely,
    and not always the same. Five new tokens a row: the program the test above compiled (top-k
    and temperature are values), so no compile of its own."""
    cfg = tiny(init_std=0.5)
    model, params, _ = built(cfg)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    logits = apply(model, params, jnp.array([[1, 2, 3]]))[0, -1]
    allowed = set(np.argsort(-np.asarray(logits))[:3].tolist())
    seen = set()
    for seed in range(20):
        out = generate(model, params, prompts[:1],
                       SamplingConfig(max_new_tokens=5, top_k=3, temperature=2.0), seed=seed)
        seen.add(out[0][0])
    assert seen <= allowed and len(seen) > 1


@pytest.mark.slow
def test_greedy_equals_argmax_of_full_forward_and_is_deterministic():
    """Each greedy token is the argmax of an uncached forward pass over the prompt and the
    tokens before it. One causal forward pass over each whole sequence (right-padded into one
    batch) gives every prefix's next-token logits at once: position t sees tokens up to t only
    (a pass per prefix compiled a program per length)."""
    cfg = tiny(position="alibi", init_std=0.3)
    model, params, _ = built(cfg)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    out = generate(model, params, prompts, sampling, seed=0)
    assert out == generate(model, params, prompts, sampling, seed=123)
    seqs = [prompt + new for prompt, new in zip(prompts, out, strict=True)]
    width = max(map(len, seqs))
    padded = jnp.array([seq + [0] * (width - len(seq)) for seq in seqs])
    logits = np.asarray(apply(model, params, padded))
    for row, (prompt, new) in enumerate(zip(prompts, out, strict=True)):
        for i, token in enumerate(new):  # the token after prompt + new[:i]
            assert token == int(np.argmax(logits[row, len(prompt) + i - 1]))


@pytest.mark.slow
def test_stop_tokens_cut_rows_and_pad_after():
    cfg = tiny(init_std=0.3)
    model, params, _ = built(cfg)
    free = generate(model, params, [[1, 2]], SamplingConfig(max_new_tokens=8, temperature=0.0))
    stop = free[0][2]
    out = generate(model, params, [[1, 2], [1, 2]],
                   SamplingConfig(max_new_tokens=8, temperature=0.0, stop_tokens=(stop,)))
    assert out[0] == free[0][: free[0].index(stop) + 1]


@pytest.mark.slow
def test_streaming_callback_sees_every_token():
    cfg = tiny(init_std=0.3)
    model, params, _ = built(cfg)
    seen = []
    out = generate(model, params, [[1, 2]], SamplingConfig(max_new_tokens=5, temperature=0.0),
                   on_token=lambda step, tok, done: seen.append((int(step), int(tok[0]))))
    assert [t for _, t in sorted(seen)] == out[0] and [s for s, _ in seen] == list(range(5))


def test_errors():
    cfg = tiny(position="learned", max_len=16)
    model, params, _ = init(cfg)
    with pytest.raises(ValueError, match="longer than position=learned allows"):
        generate(model, params, [[1] * 10], SamplingConfig(max_new_tokens=7))
    bert_like = tiny(mask="bidirectional")
    model, params, _ = init(bert_like)
    with pytest.raises(ValueError, match="does not decode left to right; use a mask that does"):
        generate(model, params, [[1]], SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


@pytest.mark.slow
def test_learned_positions_with_padding_stay_finite():
    cfg = tiny(position="learned", max_len=16, init_std=0.3)
    model, params, _ = built(cfg)
    # padding to a multiple of 16 plus 4 new tokens passes the table; real tokens do not
    out = generate(model, params, [[1, 2, 3]], SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert len(out[0]) == 4
    jax.block_until_ready(out)


@pytest.mark.slow
def test_the_decoding_loop_compiles_without_splitting_its_small_passes_over_threads():
    """``generate_tokens`` compiles with the CPU backend's decoding options here: no loop
    fusion of the decoding program is split across threads (XLA's parallel task assignment),
    while the same function compiled plainly has such splits (so the check can fail)."""
    import flax.linen as nn

    from transformers_jax import ModelConfig, build_model
    from transformers_jax.sample import generate_tokens

    cfg = ModelConfig(vocab_size=65, d_model=128, n_layers=1, n_heads=4, max_len=64,
                      dropout=0.0)
    model = build_model(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    prompts, lengths = jnp.ones((8, 8), jnp.int32), jnp.full((8,), 8, jnp.int32)
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    args = (model, params, prompts, lengths, jax.random.key(0))

    def splits(lowered) -> int:
        return lowered.compile().as_text().count('"outer_dimension_partitions":["')

    plain = jax.jit(generate_tokens.__wrapped__, static_argnames=("model", "cfg", "on_token"))
    assert splits(plain.lower(*args, greedy.values(), cfg=greedy.shape())) > 0
    assert splits(generate_tokens.lower(*args, cfg=greedy)) == 0
    # inside a caller's jit (JAX takes compile options on the outermost jit only) it is part
    # of the caller's program, with the same tokens
    top = generate_tokens(*args, cfg=greedy)
    nested = jax.jit(lambda p, x, n: generate_tokens(model, p, x, n, jax.random.key(0),
                                                     cfg=greedy))(params, prompts, lengths)
    np.testing.assert_array_equal(np.asarray(nested), np.asarray(top))
    # ... also when every argument is a constant of the caller's program
    closed = jax.jit(lambda: generate_tokens(*args, cfg=greedy))()
    np.testing.assert_array_equal(np.asarray(closed), np.asarray(top))
    scanned = jax.lax.scan(lambda c, _: (c, generate_tokens(*args, cfg=greedy)), 0, None,
                           length=1)[1][0]
    np.testing.assert_array_equal(np.asarray(scanned), np.asarray(top))
    assert generate_tokens.eval_shape(*args, cfg=greedy).shape == top.shape


def test_a_cache_the_device_cannot_hold_is_refused_with_the_limit(monkeypatch):
    """The KV cache is sized before any work: one byte short of what a request needs is
    refused, and the longest row it names is the longest whose cache fits."""
    model, params, _ = built(tiny(max_len=64))
    # 2 rows x (16 + 8) tokens: keys and values [2, 4 heads, 24, 8] x 2 layers in float32, plus
    # positions and validity per slot and the index per row
    need = 2 * 2 * (2 * 4 * 24 * 8) * 4 + 2 * 24 * (4 + 1) + 2 * 4
    assert cache_bytes(model, 2, 16, 8) == need
    check_cache_fits(model, 2, 16, 8, free_bytes=need)
    with pytest.raises(ConfigError, match=r"more than the .* GiB free") as refusal:
        check_cache_fits(model, 2, 16, 8, free_bytes=need - 1)
    most = int(re.search(r"at most about ([\d,]+) tokens a row", str(refusal.value))[1])
    assert cache_bytes(model, 2, 16, most - 16) <= need - 1 < cache_bytes(model, 2, 16, most - 15)
    # a sliding window keeps a ring of `window` slots: more tokens cost nothing, fewer rows do
    window, _, _ = built(tiny(max_len=64, mask={"name": "sliding_window", "window": 4}))
    small = cache_bytes(window, 2, 16, 8)
    with pytest.raises(ConfigError, match="does not depend on the length; sample fewer rows"):
        check_cache_fits(window, 2, 16, 8, free_bytes=small - 1)
    # generate asks the device before compiling anything
    monkeypatch.setattr(sample, "free_memory_bytes", lambda device=None: 1000)
    with pytest.raises(ConfigError, match="KV cache of 0.00 GiB, more than"):
        generate(model, params, [[1, 2, 3]], SamplingConfig(max_new_tokens=8))
