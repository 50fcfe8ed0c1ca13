"""Context parallelism (``parallel/context.py``): a tiny GPT whose sequences are split over the
``context`` mesh axis computes the logits, loss and gradients of one device, for every position
scheme, by every method (all-gather of keys/values, ring, ring in zigzag order), and trains as
one device does; the ring computes only the tiles its mask shows (a count per device), evenly
in zigzag order, and keeps no scores for its backward.

Tolerances (float32, 8 fake CPU devices): logits to 1e-5 absolute (observed ~2e-7), the loss
to 1e-6 relative, every gradient to 2e-5 of the largest gradient entry (observed ~6e-7; the
key projection's bias, whose true gradient is zero, is noise of ~1e-8 on both sides).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from model_helpers import packed_rows

from transformers_jax import ConfigError, ModelConfig, TrainConfig, build_model
from transformers_jax.learning.optim import make_optimizer
from transformers_jax.nn.attention import dot_product_attention
from transformers_jax.nn.mask_kinds import SlidingWindow
from transformers_jax.nn.masks import build_mask
from transformers_jax.parallel import LOGICAL_RULES, format_mesh, make_mesh, make_trainer
from transformers_jax.parallel.context import ring_attention
from transformers_jax.parallel.mesh import parse_mesh
from transformers_jax.parallel.rules import context_parallel_size
from transformers_jax.parallel.strategies import mesh_rules
from transformers_jax.registry import POSITIONS

B, T = 4, 64
GPT = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_len=T)
# The fast set by every method (and mesh): no positions and a bias; every other scheme with a
# bias by two methods, one without by one (``_cases``). Each mesh case is a compile of its own
# (the one-device reference and the parameters are built once per config); the quick tier
# keeps one case per method (QUICK), each with a scheme of another kind (no positions, rotary,
# a bias); the rest is marked slow.
FAST = ("none", "alibi")
QUICK = {("rope", "all_gather"), ("none", "ring_zigzag"), ("alibi", "ring")}
METHODS = {"ring": "data=2,context=4", "all_gather": "context=4",
           "ring_zigzag": "data=2,context=4"}


def _batch(extra: str | None = None) -> dict:
    """Random tokens; ``extra="packed"``: two documents per row (segment ids, positions
    restarting at the cut); ``"prefix"``: a prefix length per row (prefix-LM)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, GPT.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if extra == "prefix":
        batch["prefix_len"] = np.array([5, 16, 30, 50], np.int32)
    if extra == "packed":
        cut = rng.integers(8, T - 8, size=B)
        batch.update(packed_rows(cut, T))
    return batch


@functools.cache
def _setup(cfg: ModelConfig, extra: str | None = None):
    """(model, batch, its model keys, params): built and initialised once per config and
    batch, shared by the one-device reference and every method's mesh run."""
    model = build_model(cfg)
    batch = _batch(extra)
    keys = {k: batch[k] for k in ("positions", "segment_ids", "prefix_len") if k in batch}
    params = jax.jit(lambda: model.init(jax.random.key(0), batch["inputs"], **keys))()["params"]
    return model, batch, keys, params


@functools.cache
def _run(cfg: ModelConfig, mesh_spec: str | None, method: str = "all_gather",
         extra: str | None = None):
    """(logits, loss, grads) of the mean next-token loss in training mode (randomized schemes
    draw their positions), on one device or traced under ``mesh_spec``; memoised, so the
    one-device reference of a config is computed once for all its methods."""
    model, batch, keys, params = _setup(cfg, extra)

    def loss(p):
        logits = model.apply({"params": p}, batch["inputs"], **keys, deterministic=False,
                             rngs={"dropout": jax.random.key(1)})
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return nll.mean(), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh_spec is None:
        (value, logits), grads = step(params)
    else:
        mesh = make_mesh(mesh_spec, devices=jax.devices()[: _size(mesh_spec)])
        with mesh_rules(mesh, LOGICAL_RULES, method):
            lowered = step.lower(params)  # traced and lowered once: checked, then compiled
            # the hook ran (not GSPMD on its own): the method's collective is in the program
            collective = {"ring": "collective_permute", "all_gather": "all_gather",
                          "ring_zigzag": "collective_permute"}[method]
            assert collective in lowered.as_text()
            (value, logits), grads = lowered.compile()(params)
    return np.asarray(logits), float(value), jax.tree.map(np.asarray, grads)


def _size(spec: str) -> int:
    return int(np.prod([int(part.split("=")[1]) for part in spec.split(",")]))


def _assert_same(got, want) -> None:
    logits, loss, grads = got
    want_logits, want_loss, want_grads = want
    np.testing.assert_allclose(logits, want_logits, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    scale = max(np.abs(g).max() for g in jax.tree.leaves(want_grads))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


def _cases():
    """The fast set by every method; every other scheme that adds a bias by the zigzag ring
    (the most moving parts) and by ring or all-gather in turn; a scheme without one by the
    all-gather alone. Under the jit strategy only attention is mapped over the shards: a
    scheme without a bias rotates q and k or adds to the embeddings before the hook, which
    then sees what it sees for ``none`` (run by every method), so one method proves the
    scheme (GSPMD splitting its positions) and a second proves nothing more; a bias goes
    through each method's own slicing of its rows and keys, so it keeps two."""
    for i, name in enumerate(POSITIONS.names()):
        if name in FAST:
            methods = list(METHODS)
        elif GPT.replace(position=name).position.adds_bias:
            methods = ["ring_zigzag", ("ring", "all_gather")[i % 2]]
        else:
            methods = ["all_gather"]
        for method in methods:
            marks = () if (name, method) in QUICK else (pytest.mark.slow,)
            yield pytest.param(name, method, marks=marks, id=f"{name}-{method}")


@pytest.mark.parametrize("position, method", list(_cases()))
def test_context_parallel_equals_one_device(position, method):
    cfg = GPT.replace(position=position)
    _assert_same(_run(cfg, METHODS[method], method), _run(cfg, None))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ring_zigzag"])
@pytest.mark.parametrize("mask", ["prefix", "window_packed", "causal_packed"])
def test_context_parallel_masks(mask, method):
    """Masks by positions, not indices, through the ring (blocks skipped by what the mask
    says, queries in zigzag order): a prefix-LM whose prefixes end in different shards
    (queries see keys of later shards), a window reaching over shard boundaries on packed
    documents (positions restarting, segment ids), causal packed documents."""
    masks = {"prefix": "prefix", "window_packed": {"name": "sliding_window", "window": 24},
             "causal_packed": "causal"}
    cfg = GPT.replace(position="alibi", mask=masks[mask])
    extra = "prefix" if mask == "prefix" else "packed"
    _assert_same(_run(cfg, "data=2,context=4", method, extra), _run(cfg, None, extra=extra))


@pytest.mark.slow
def test_train_steps_equal_one_device():
    """Two AdamW steps of the jit strategy on data=2 x context=4 (ring): the losses and
    parameters of one device."""
    model = build_model(GPT.replace(position="rope"))
    batch = {**_batch(), "weights": np.ones((B, T), np.float32)}
    optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=2, learning_rate=1e-3))
    runs = {}
    for strategy, mesh in (("single", None), ("jit", "data=2,context=4")):
        trainer = make_trainer(strategy, model, optimizer, batch, mesh=mesh,
                               context_attention="ring")
        state, losses = trainer.init_state(0), []
        if strategy == "jit":  # the ring runs: its hops are in the step's program (lowered
            # for this state and batch, the lowering the step then reuses)
            lowered = trainer.lower(state, trainer.place_batch(batch))
            assert "collective_permute" in lowered.as_text()
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[strategy] = losses, jax.tree.map(np.asarray, trainer.unreplicate(state).params)
    np.testing.assert_allclose(runs["jit"][0], runs["single"][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                 runs["jit"][1], runs["single"][1])


def test_context_axis_in_mesh_specs_and_rules():
    """The axis is 1 unless asked for, and then leaves every old spec spelled as it was."""
    assert parse_mesh("data=2,context=4", 8) == {"data": 2, "fsdp": 1, "context": 4,
                                                  "tensor": 1}
    assert format_mesh(parse_mesh("data=2,context=4", 8)) == "data=2,fsdp=1,context=4,tensor=1"
    assert format_mesh(parse_mesh("data=8", 8)) == "data=8,fsdp=1,tensor=1"
    assert context_parallel_size(make_mesh("data=8")) == 1
    assert context_parallel_size(make_mesh("data=2,context=4")) == 4
    with pytest.raises(ConfigError, match="product is 8, e.g. 'data=2,fsdp=1,context=4"):
        parse_mesh("data=4,context=4", 8)
    # Outside a context mesh the hook is not set: the kernel itself runs.
    q = jnp.ones((1, 8, 2, 4))
    with mesh_rules(make_mesh("data=8")):
        out = dot_product_attention(q, q, q)
    np.testing.assert_allclose(out, 1.0)


def test_refusals_name_what_works():
    model = build_model(GPT)
    batch = _batch()
    optimizer = optax.sgd(0.1)
    with pytest.raises(ConfigError, match="'pmap' splits only data.*context=4.*strategy=jit"):
        make_trainer("pmap", model, optimizer, batch, mesh="data=2,context=4")
    with pytest.raises(ConfigError, match="length 60, which does not split into 8"):
        make_trainer("jit", model, optimizer, {k: v[:, :60] for k, v in batch.items()},
                     mesh="context=8")
    with pytest.raises(ConfigError, match="context_attention='zigzag': valid choices: "
                       "all_gather, ring, ring_zigzag"):
        make_trainer("jit", model, optimizer, batch, mesh="data=2,context=4",
                     context_attention="zigzag")
    with pytest.raises(ConfigError, match="length 36, which does not split into 8 zigzag "
                       "chunks.*multiple of 8.*or train.context_attention=ring"):
        make_trainer("jit", model, optimizer, {k: v[:, :36] for k, v in batch.items()},
                     mesh="data=2,context=4", context_attention="ring_zigzag")
    pallas = build_model(GPT.replace(attention="pallas"))
    with pytest.raises(ConfigError, match="use train.context_attention=ring, or "
                       "attention=chunked"):
        make_trainer("jit", pallas, optimizer, batch, mesh="data=2,context=4")
    with pytest.raises(ConfigError, match="train.context_attention"):
        TrainConfig(context_attention="zigzag")


RING = {"B": 2, "T": 32, "H": 2, "N": 1, "D": 8, "ways": 4}


def _ring_mask(kind: str):
    """A mask over RING's rows: causal, a window of 8 (one shard), bidirectional, a prefix per
    row, or causal packed documents (positions restart at a cut, segment ids)."""
    t, b = RING["T"], RING["B"]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if kind == "packed":
        seg = (jnp.arange(t)[None] >= jnp.array([[10], [21]])).astype(jnp.int32)
        pos = jnp.where(seg == 0, pos, pos - jnp.array([[10], [21]]))
        return build_mask("causal", pos, pos, q_segments=seg, kv_segments=seg)
    if kind == "prefix":
        return build_mask("prefix", pos, pos, prefix_len=jnp.array([5, 20]))
    if kind == "window":
        return build_mask(SlidingWindow(window=8), pos, pos)
    return build_mask(kind, pos, pos)


def _ring_direct(kind: str, zigzag: bool, dense: bool = False):
    """Ring attention of random q, k, v on ``ways`` devices (the sequence split over them):
    the output, the reference kernel's on one device, and the tiles each device computed.
    ``dense``: the mask given as a boolean ``[B, 1, T, T]`` array, split along queries."""
    b, t, h, n, d, ways = (RING[x] for x in ("B", "T", "H", "N", "D", "ways"))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
               for heads in (h, n, n))
    mask = _ring_mask(kind).dense() if dense else _ring_mask(kind)
    mesh = Mesh(np.array(jax.devices()[:ways]), ("context",))

    def local(q, k, v, mask):
        out, tiles = ring_attention(q, k, v, None, mask, axis="context", ways=ways,
                                    zigzag=zigzag, scale=d**-0.5)
        return out, tiles[None]  # [1, steps]

    spec = P(None, "context")
    mask_spec = jax.tree.map(lambda x: P(None) if x.ndim == 1 else spec, mask)
    if dense:
        mask_spec = P(None, None, "context", None)
    out, tiles = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, mask_spec),
                                       out_specs=(spec, P("context"))))(q, k, v, mask)
    want = dot_product_attention(q, k, v, mask=mask, implementation="reference")
    dense_mask = np.asarray(_ring_mask(kind).dense())
    return np.asarray(out), np.asarray(want), np.asarray(tiles), dense_mask


def _tiles_with_a_visible_pair(dense, ways: int, zigzag: bool) -> np.ndarray:
    """``[device, step]``: the (query tile, key tile) pairs in which the dense mask has any
    True, the work the ring cannot skip. At step s device i holds the keys of device i - s.
    Contiguous: a device's queries and keys are its shard, one tile; zigzag: chunks i and
    2c-1-i of 2c, four tiles."""
    chunks = 2 * ways if zigzag else ways
    size = dense.shape[-1] // chunks
    seen = dense.any(axis=(0, 1)).reshape(chunks, size, chunks, size).any(axis=(1, 3))

    def mine(i):
        return [i, 2 * ways - 1 - i] if zigzag else [i]

    return np.array([[seen[np.ix_(mine(i), mine((i - step) % ways))].sum()
                      for step in range(ways)] for i in range(ways)])


# causal (the exact counts of both orders) in the quick tier; each kind is two compiles
@pytest.mark.parametrize("kind", ["causal", *(pytest.param(k, marks=pytest.mark.slow) for k in
                                              ("window", "prefix", "bidirectional", "packed",
                                               "dense"))])
def test_ring_computes_only_the_tiles_the_mask_shows(kind):
    """Each device counts the tiles it computed at each ring step (a ``lax.cond`` skips the
    others): exactly those in which the dense mask has a visible pair, decided from
    positions; everything for a bidirectional mask; on packed rows (positions restarting) no
    fewer, and the segment ids still skip some; a dense boolean mask (packed rows as an
    array) exactly. Causal: on the contiguous ring device i computes the block of step s
    only for s <= i, so every step waits for a whole block on the last device; in zigzag
    order every device computes 3 quarter blocks on the first step and 2 on every other.
    The output is the reference's."""
    ways = RING["ways"]
    for zigzag in (False, True):
        if kind == "dense":
            out, want, tiles, dense = _ring_direct("packed", zigzag, dense=True)
        else:
            out, want, tiles, dense = _ring_direct(kind, zigzag)
        np.testing.assert_allclose(out, want, atol=1e-5)
        needed = _tiles_with_a_visible_pair(dense, ways, zigzag)
        every = 4 if zigzag else 1  # tiles per step
        if kind == "packed":
            assert (needed <= tiles).all() and tiles.sum() < every * ways * ways, tiles
        else:
            np.testing.assert_array_equal(tiles, needed)
        if kind == "bidirectional":
            assert (tiles == every).all()
        if kind == "causal":
            steps = np.arange(ways)
            want_tiles = ([[3] + [2] * (ways - 1)] * ways if zigzag else
                          [(steps <= i).astype(int) for i in range(ways)])
            np.testing.assert_array_equal(tiles, want_tiles)


@pytest.mark.slow
def test_ring_backward_keeps_no_scores():
    """The ring's steps are rematerialised: what the forward keeps for the backward (``jax.vjp``'s
    residuals) no longer grows with the scores, ``[q, K]`` per device, and the compiled
    gradient's temporaries shrink (1 x 1024 tokens, 4 heads of 16, 4 devices, causal)."""
    ways, t, h, d = 4, 1024, 4, 16
    mesh = Mesh(np.array(jax.devices()[:ways]), ("context",))
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def measure(recompute):
        def loss(q, k, v):
            def local(q, k, v, mask):
                return ring_attention(q, k, v, None, mask, axis="context", ways=ways,
                                      zigzag=True, scale=d**-0.5, recompute=recompute)[0]

            spec = P(None, "context")
            out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(
                q, k, v, build_mask("causal", pos, pos))
            return jnp.sum(out * q)

        kept = jax.eval_shape(lambda *a: jax.vjp(loss, *a)[1], x, x, x)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return (sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(kept)),
                compiled.memory_analysis().temp_size_in_bytes)

    (kept_all, temp_all), (kept_few, temp_few) = measure(False), measure(True)
    scores = ways * (t // ways) * t * h * 4  # every device's [h, q, K] float32 scores
    assert kept_all > scores and kept_all > 10 * kept_few, (kept_all, kept_few)  # 45 MB, 3.3 MB
    assert temp_few < 0.6 * temp_all, (temp_all, temp_few)
