"""Decoding with the KV cache gives the same logits as a full forward pass over the prefix.

Each model config is initialised once and its full forward pass computed once
(``decode_fixtures.built`` / ``full_logits``); the cached steps run through one module-level
jitted ``decode_step`` taking the params as an argument, compiled once per config and shape.
The quick tier (``-m "not slow"``) keeps one case of each kind of check; CI runs them all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import apply, built, decode_step, full_logits, init_params
from model_helpers import POSITIONS, mask_settings, tiny
from model_helpers import attention as attention_switch
from subprocess_env import USER_KERNELS

from transformers_jax import ModelConfig, build_model, sample
from transformers_jax.nn.kvcache import init_cache, plan_write

slow = pytest.mark.slow
# sample.py's prefill and decoding step, compiled once per model and shape
_prefill = jax.jit(sample.prefill, static_argnums=(0, 4))
_decode_step = jax.jit(sample.decode_step, static_argnums=0)


def cached_logits(model, params, cfg, tokens, prompt_lengths, cache_size, one_row=False,
                  width=None):
    """Prefill prompts of different lengths, right-padded to ``width`` (default: the longest),
    then feed the rest one at a time.

    Returns logits [B, T, V] at every position, each computed through the cache. ``one_row``
    decodes each row as a batch of one (steps then read the cache before writing to it:
    ``RowSlot.read_first``), its prompt padded as in the batch (one compiled prefill for all
    rows); otherwise all rows together (write, then read).
    """
    if one_row:
        return np.concatenate([
            cached_logits(model, params, cfg, tokens[b : b + 1], prompt_lengths[b : b + 1],
                          cache_size, width=int(max(prompt_lengths)))
            for b in range(tokens.shape[0])])
    B, T = tokens.shape
    P = width or int(max(prompt_lengths))
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    prompt = jnp.where(jnp.arange(P)[None] < lengths[:, None], tokens[:, :P], 0)
    cache = init_cache(cfg, B, cache_size)

    def step(cache, tokens, lengths):
        return decode_step(model, params, cache, tokens, lengths)

    logits, cache = step(cache, prompt, lengths)
    out = np.zeros((B, T, cfg.vocab_size), np.float32)
    for b in range(B):
        out[b, : prompt_lengths[b]] = logits[b, : prompt_lengths[b]]
    ones = jnp.ones((B,), jnp.int32)
    for j in range(T - min(prompt_lengths)):
        pos = np.minimum(np.asarray(prompt_lengths) + j, T - 1)
        tok = tokens[jnp.arange(B), pos][:, None]
        logits, cache = step(cache, tok, ones)
        for b in range(B):
            if prompt_lengths[b] + j < T:
                out[b, prompt_lengths[b] + j] = logits[b, 0]
    return out


QUICK_POSITION = "rope"  # the quick tier decodes this scheme; CI decodes every one


def _position_cases():
    """Every registered scheme, decoded as a batch and row by row. The quick tier keeps rope
    as a batch, and the schemes that refuse a cache (no compile: cheap)."""
    for position in POSITIONS:
        for one_row, name in ((False, "batch"), (True, "one-row")):
            quick = (position == QUICK_POSITION and not one_row
                     or not tiny(position=position).position.cacheable)
            yield pytest.param(position, one_row, id=f"{position}-{name}",
                               marks=() if quick else slow)


@pytest.mark.parametrize(("position", "one_row"), _position_cases())
def test_cached_decoding_equals_full_forward(position, one_row):
    cfg = tiny(position=position, n_kv_heads=2, init_std=0.1)
    if not cfg.position.cacheable:  # it says so: making a cache fails, naming the fix
        with pytest.raises(ValueError, match="cannot reproduce"):
            init_cache(cfg, 2, 12)
        return  # (its cacheable setting is checked in test_positions_new.py)
    model, params, tokens = built(cfg, T=12)
    cached = cached_logits(model, params, cfg, tokens, [4, 7], cache_size=12, one_row=one_row)
    np.testing.assert_allclose(cached, full_logits(cfg, T=12), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("reads_first", [False, True], ids=["writes-first", "reads-first"])
def test_either_decoding_order_gives_the_full_forward_pass(reads_first, monkeypatch):
    """A decoding step's order is its backend's (``backends.decode_reads_first``: XLA:CPU
    reads the cache first for one row, TPU and GPU always write first): either order, for one
    row and for a batch, gives the full forward pass's logits."""
    from transformers_jax.backends.cpu import CpuMaths

    monkeypatch.setattr(CpuMaths, "decode_reads_first", lambda self, batch: reads_first)
    cfg = tiny(position=QUICK_POSITION, n_kv_heads=2, init_std=0.1)
    model, params, tokens = built(cfg, T=12)
    full = full_logits(cfg, T=12)
    for one_row in (False, True):
        cached = cached_logits(model, params, cfg, tokens, [4, 7], cache_size=12,
                               one_row=one_row)
        np.testing.assert_allclose(cached, full, atol=2e-5, rtol=1e-5)


@slow
@pytest.mark.parametrize("one_row", [False, True], ids=["batch", "one-row"])
@pytest.mark.parametrize("attention", ["reference", "chunked"])
def test_sliding_window_ring_cache_holds_only_the_window(attention, one_row):
    cfg = tiny(mask={"name": "sliding_window", "window": 4}, position="alibi",
               attention=attention_switch(attention), init_std=0.1)
    model, params, tokens = built(cfg, T=14)
    full = full_logits(cfg, T=14)
    size = cfg.mask.cache_slots(14)
    assert size == 4
    # a prompt longer than the ring: only its last 4 tokens stay in the cache
    cached = cached_logits(model, params, cfg, tokens, [6, 9], cache_size=size, one_row=one_row)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=1e-5)


@slow
def test_rope_scaling_and_gqa_in_cache():
    cfg = tiny(n_kv_heads=1, position={"name": "rope", "scaling": {
                   "name": "yarn", "factor": 2.0, "original_max_len": 8}},
               mlp="swiglu", norm="rmsnorm", qk_norm=True, init_std=0.1)
    model, params, tokens = built(cfg, T=10)
    cached = cached_logits(model, params, cfg, tokens, [1, 5], cache_size=10)
    np.testing.assert_allclose(cached, full_logits(cfg, T=10), atol=2e-5, rtol=1e-5)


@slow
@pytest.mark.parametrize("length", ["position", "sequence"])
def test_dynamic_ntk_per_position_decodes_as_the_full_forward_pass(length):
    """Dynamic NTK's base grows with the current length. With ``length='position'`` every
    query and key at position t uses t + 1, in a forward pass as in decoding, so the two agree
    past the original length; with ``sequence`` (one base per window, as Hugging Face) a
    window of 12 differs from decoding it token by token (the test is not vacuous)."""
    cfg = tiny(position={"name": "rope", "scaling": {
                   "name": "dynamic_ntk", "factor": 4.0, "original_max_len": 4,
                   "length": length}}, init_std=0.3)
    model, params, tokens = built(cfg, T=12)
    full = full_logits(cfg, T=12)
    cached = cached_logits(model, params, cfg, tokens, [1, 1], cache_size=12)
    if length == "position":
        np.testing.assert_allclose(cached, full, atol=2e-5, rtol=1e-5)
    else:
        assert np.abs(cached - full).max() > 1e-3


def test_plan_write_ring_order():
    # a ring of 4 slots, 6 new tokens starting at index 0: tokens 4, 5 overwrite slots 0, 1
    plan = plan_write(jnp.array([0, 2]), jnp.array([6, 1]), size=4, n_new=6)
    np.testing.assert_array_equal(plan.take[0], [4, 5, 2, 3])
    np.testing.assert_array_equal(plan.write[0], [True] * 4)
    # row 1: one token at index 2 goes to slot 2 only
    np.testing.assert_array_equal(plan.write[1], [False, False, True, False])
    assert int(plan.take[1, 2]) == 0


@pytest.mark.parametrize("position", ["t5", *(pytest.param(p, marks=slow)
                                             for p in ("rope", "learned", "alibi"))])
def test_encoder_decoder_cached_decoding_equals_full_forward(position):

    cfg = ModelConfig(family="encdec", vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_len=16, position=position, init_std=0.2)
    model = build_model(cfg)
    src = jax.random.randint(jax.random.key(1), (2, 7), 0, 32)
    tgt = jax.random.randint(jax.random.key(2), (2, 6), 0, 32)
    valid = jnp.array([[True] * 7, [True] * 4 + [False] * 3])  # second source is padded
    seg = valid.astype(jnp.int32)
    params = init_params(model, jax.random.key(0), tgt, encoder_inputs=src)
    full = apply(model, params, tgt, encoder_inputs=src, encoder_segment_ids=seg)
    encoded = apply(model, params, src, encoder_segment_ids=seg, method="encode")
    cache = model.init_cache(2, 7, 7).replace(encoder_valid=valid)
    # prefill 3 tokens, projecting the encoder
    logits, cache = decode_step(model, params, cache, tgt[:, :3], encoded=encoded)
    cached = [logits]
    for t in range(3, 6):  # then one token at a time, reading the stored cross keys/values
        logits, cache = decode_step(model, params, cache, tgt[:, t : t + 1])
        cached.append(logits)
    np.testing.assert_allclose(jnp.concatenate(cached, 1), full, atol=2e-5, rtol=1e-5)


@slow
def test_encoder_decoder_generate_equals_uncached_greedy():
    from transformers_jax.models.encdec import greedy_decode
    from transformers_jax.sample import SamplingConfig, generate

    cfg = ModelConfig(family="encdec", vocab_size=32, d_model=32, n_layers=1, n_heads=2,
                      position="t5", init_std=0.3)
    model = build_model(cfg)
    src = jnp.array([[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]])
    params = init_params(model, jax.random.key(0), src, encoder_inputs=src)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, bos_id=1, pad_id=0)
    out = generate(model, params, src.tolist(), sampling)
    reference = greedy_decode(model, params, src, max_len=6, bos_id=1, eos_id=-1, pad_id=0)
    assert out == np.asarray(reference).tolist()


def _decoding_masks() -> list[str]:
    from transformers_jax.registry import MASKS

    return [name for name, kind in MASKS.items() if kind.decodes]


@pytest.mark.parametrize("mask", _decoding_masks())
def test_every_decoding_mask_kind_generates_what_the_full_forward_pass_predicts(mask):
    """For each registered mask kind that decodes (a new one is covered once registered):
    prefill a prompt, then decode greedily; every step's logits equal those of a full forward
    pass over the prompt plus the tokens so far. A prefix-LM takes the prompt as its prefix.

    A kind that decodes lets no position see a later one, so one full pass over the final
    sequence gives every step's logits at once (a pass per length compiled a program each);
    a kind that leaked later tokens into earlier positions fails here."""
    cfg = tiny(mask={"name": mask, **mask_settings(mask)}, position="rope", init_std=0.3)
    lengths = jnp.array([5], jnp.int32)
    inputs = {"prefix_len": lengths} if cfg.mask.needs_prefix_len else {}
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.key(1), (1, 5), 0, cfg.vocab_size)
    params = init_params(model, jax.random.key(0), tokens, **inputs)
    logits, cache = _prefill(model, params, tokens, lengths, 4)
    seq, steps = tokens, []
    for _ in range(4):
        steps.append(logits)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, token[:, None]], axis=1)
        logits, cache = _decode_step(model, params, token, cache)
    full = apply(model, params, seq[:, :-1], **inputs)  # positions 0 .. 7
    for i, logits in enumerate(steps):  # step i predicts position 5 + i from positions <= 4 + i
        np.testing.assert_allclose(logits, full[:, 4 + i], atol=2e-5, rtol=1e-5)


@slow
@pytest.mark.parametrize("batch", [1, 4])
def test_decode_loop_updates_the_cache_in_place(batch):
    """The compiled generate loop holds no copy of a layer's cache: each step's update is in
    place (at batch 1 XLA:CPU copied every layer's keys and values twice per token until the
    write was made to depend on the attention output: the CPU backend's ``ordered_after``)."""
    import re

    from transformers_jax.sample import SamplingConfig, generate_tokens

    cfg = tiny(max_len=64)
    model, params, _ = built(cfg)
    prompts = jnp.ones((batch, 4), jnp.int32)
    lengths = jnp.full((batch,), 4, jnp.int32)
    hlo = generate_tokens.lower(model, params, prompts, lengths, jax.random.key(0),
                                cfg=SamplingConfig(max_new_tokens=20)).compile(
        USER_KERNELS).as_text()  # the kernels users get, not the suite's cheap ones
    N, D, S = cfg.kv_heads, cfg.dims_per_head, 4 + 20
    cache_shape = rf"f32\[{batch},{N},{S},{D}\]"
    # the decoding loop is the while loop whose body updates the cache (the others are the
    # prefill's attention tiles); copies at the loop's entry happen once, not per token
    bodies = [c for c in re.split(r"\n(?=\S)", hlo) if re.match(r"%?[\w.\-]+ ", c)
              and c.split(" ", 1)[0].lstrip("%") in re.findall(r"body=%?([\w.\-]+)", hlo)]
    loop = [c for c in bodies if re.search(rf"= {cache_shape}\S* (fusion|scatter|dynamic-update)",
                                           c)]
    assert len(loop) == 1
    assert not re.findall(rf"= {cache_shape}\S* copy\(", loop[0])
