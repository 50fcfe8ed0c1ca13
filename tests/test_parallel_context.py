"""Context parallelism (``parallel/context.py``): a tiny GPT whose sequences are split over the
``context`` mesh axis computes the logits, loss and gradients of one device, for every position
scheme, by both methods (all-gather of keys/values, ring), and trains as one device does.

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

from transformers_jax import ConfigError, ModelConfig, TrainConfig, build_model
from transformers_jax.nn.attention import dot_product_attention
from transformers_jax.parallel import LOGICAL_RULES, format_mesh, make_mesh, make_trainer
from transformers_jax.parallel.mesh import parse_mesh
from transformers_jax.parallel.rules import context_parallel_size
from transformers_jax.parallel.strategies import mesh_rules
from transformers_jax.registry import POSITIONS
from transformers_jax.train.optim import make_optimizer

B, T = 4, 64
GPT = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_len=T)
# Every scheme runs once; the fast set also runs by the other method (and mesh). Each case is
# about three tiny compiles (one device, the mesh), so the rest is marked slow.
FAST = ("none", "rope", "alibi")
METHODS = {"ring": "data=2,context=4", "all_gather": "context=4"}


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
        seg = (np.arange(T)[None] >= cut[:, None]).astype(np.int32) + 1
        batch["segment_ids"] = seg
        batch["positions"] = np.where(seg == 1, np.arange(T), np.arange(T) - cut[:, None])
        batch["positions"] = batch["positions"].astype(np.int32)
    return batch


@functools.cache
def _run(cfg: ModelConfig, mesh_spec: str | None, method: str = "all_gather",
         extra: str | None = None):
    """(logits, loss, grads) of the mean next-token loss in training mode (randomized schemes
    draw their positions), on one device or traced under ``mesh_spec``."""
    model = build_model(cfg)
    batch = _batch(extra)
    keys = {k: batch[k] for k in ("positions", "segment_ids", "prefix_len") if k in batch}
    params = jax.jit(lambda: model.init(jax.random.key(0), batch["inputs"], **keys))()["params"]

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
            (value, logits), grads = step(params)
            # the hook ran (not GSPMD on its own): the method's collective is in the program
            collective = {"ring": "collective_permute", "all_gather": "all_gather"}[method]
            assert collective in step.lower(params).as_text()
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
    for i, name in enumerate(POSITIONS.names()):
        methods = list(METHODS) if name in FAST else [list(METHODS)[i % 2]]
        for method in methods:
            marks = () if name in FAST else (pytest.mark.slow,)
            yield pytest.param(name, method, marks=marks, id=f"{name}-{method}")


@pytest.mark.parametrize("position, method", list(_cases()))
def test_context_parallel_equals_one_device(position, method):
    cfg = GPT.replace(position=position)
    _assert_same(_run(cfg, METHODS[method], method), _run(cfg, None))


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["prefix", "window_packed"])
def test_context_parallel_masks(mask):
    """Masks by positions, not indices, through the ring: a prefix-LM whose prefixes end in
    different shards (queries see keys of later shards), and a window reaching over shard
    boundaries on packed documents (positions restarting, segment ids)."""
    masks = {"prefix": "prefix", "window_packed": {"name": "sliding_window", "window": 24}}
    cfg = GPT.replace(position="alibi", mask=masks[mask])
    extra = "prefix" if mask == "prefix" else "packed"
    _assert_same(_run(cfg, "data=2,context=4", "ring", extra), _run(cfg, None, extra=extra))


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
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        if strategy == "jit":  # the ring ran: its hops are in the step's program
            lowered = trainer.lower(trainer.abstract_state(), trainer.abstract_batch(batch))
            assert "collective_permute" in lowered.as_text()
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
    with pytest.raises(ConfigError, match="data parallel only.*context=4.*strategy=jit"):
        make_trainer("shard_map", model, optimizer, batch, mesh="data=2,context=4")
    with pytest.raises(ConfigError, match="length 60, which does not split into 8"):
        make_trainer("jit", model, optimizer, {k: v[:, :60] for k, v in batch.items()},
                     mesh="context=8")
    with pytest.raises(ConfigError, match="context_attention='zigzag': valid choices: "
                       "all_gather, ring"):
        make_trainer("jit", model, optimizer, batch, mesh="data=2,context=4",
                     context_attention="zigzag")
    pallas = build_model(GPT.replace(attention="pallas"))
    with pytest.raises(ConfigError, match="use train.context_attention=ring, or "
                       "attention=chunked"):
        make_trainer("jit", pallas, optimizer, batch, mesh="data=2,context=4")
    with pytest.raises(ConfigError, match="train.context_attention"):
        TrainConfig(context_attention="zigzag")
