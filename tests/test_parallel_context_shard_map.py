"""Context parallelism under the ``shard_map`` strategy: each device runs the model on its
``[b, T/c]`` shard of every batch array, with its tokens' global positions, and attention
crosses the shards by the ring or an all-gather inside the mapped step. One training step
gives the loss and parameters of the ``single`` strategy for every position scheme the
registry allows there (the bias schemes' biases built against every key's positions; the
others are refused, naming ``train.strategy=jit``) and for
causal, window, prefix and packed-segment masks; a few steps give its losses.

Tolerances (float32, 8 fake CPU devices): the loss to 1e-6 relative; the change of every
parameter in one SGD step (the gradient times the learning rate: AdamW would turn the key
projection's bias, whose true gradient is zero, into +-lr of noise) to 2e-5 of the largest
change; the losses of three AdamW steps to 1e-5 relative.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from model_helpers import packed_rows

from transformers_jax import ConfigError, ModelConfig, build_model
from transformers_jax.learning.objectives import objective_for
from transformers_jax.parallel import make_trainer
from transformers_jax.parallel.context import shard_refusal
from transformers_jax.registry import POSITIONS

B, T = 4, 32
GPT = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_len=T)
# the cells of the schemes with a bias cycle through these (method, mesh); every method runs at
# least once (``_schemes``)
RUNS = (("ring", "data=2,context=4"), ("all_gather", "data=2,context=4"),
        ("ring_zigzag", "data=1,context=8"))


def _batch(extra: str | None = None) -> dict:
    """Random tokens and unit weights; ``"packed"``: two documents per row (segment ids,
    positions restarting at the cut); ``"prefix"``: a prefix length per row."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, GPT.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "weights": rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)}
    if extra == "prefix":
        batch["prefix_len"] = np.array([3, 9, 15, 26], np.int32)
    if extra == "packed":
        cut = np.array([5, 12, 17, 28])  # a cut inside different shards
        batch.update(packed_rows(cut, T))
    return batch


def _optimizer(steps: int) -> optax.GradientTransformation:
    return optax.sgd(0.5) if steps == 1 else optax.adamw(1e-2)


@functools.cache
def _initial_state(cfg: ModelConfig, extra: str | None = None, objective=None, steps: int = 1):
    """``init_state(0)`` of the single strategy, on the host: built once per config and shared
    by the single run and the shard_map run of one SGD step (``init_state`` gives the same
    values whichever strategy asks: the shard_map trainer's own is run by the AdamW steps)."""
    trainer = make_trainer("single", build_model(cfg), _optimizer(steps), _batch(extra),
                           objective=objective)
    return jax.device_get(trainer.init_state(0))


@functools.cache
def _train(cfg: ModelConfig, strategy: str, mesh: str | None = None, method: str = "ring",
           extra: str | None = None, steps: int = 1, grad_accum: int = 1, objective=None):
    """(losses, the change of the params) of ``steps`` SGD steps (one), else AdamW steps."""
    batch = _batch(extra)
    trainer = make_trainer(strategy, build_model(cfg), _optimizer(steps), batch, mesh=mesh,
                           context_attention=method, grad_accum=grad_accum, objective=objective)
    if steps == 1 or strategy == "single":
        state = trainer.place_state(_initial_state(cfg, extra, objective, steps))
    else:
        state = trainer.init_state(0)
    losses = []
    start = jax.tree.map(np.asarray, trainer.unreplicate(state).params)
    if strategy == "shard_map":  # the method's collective is in the step: it crossed shards
        # (lowered for this state and batch: the lowering the step then reuses)
        text = trainer.lower(state, trainer.place_batch(batch)).as_text()
        assert {"all_gather": "all_gather"}.get(method, "collective_permute") in text
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    end = jax.tree.map(np.asarray, trainer.unreplicate(state).params)
    return losses, jax.tree.map(np.subtract, end, start)


def _assert_same(got, want) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    scale = max(np.abs(w).max() for w in jax.tree.leaves(want[1]))
    assert scale > 1e-3  # the step moved the parameters
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[1])[0],
                            jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


# the quick tier keeps the all-gather and the zigzag ring (with a bias scheme) and the refused
# scheme (each cell is three tiny compiles: the single run's init and step, the shard_map
# step); the rest are marked slow
FAST = ("none", "kerple", "randomized")


def _schemes():
    """Every scheme once. One with a bias (its rows and keys sliced by each method in its own
    way) takes the next of ``RUNS``; one without reaches attention only through the rotated q
    and k or the embeddings, which every method treats as it treats ``none``'s, so it takes
    the all-gather, the cheapest to compile (issue 61: the ring's own cases are the bias
    schemes', the masks' and the steps' below)."""
    biased = 0
    for name in POSITIONS.names():
        if GPT.replace(position=name).position.adds_bias:
            method, mesh = RUNS[biased % len(RUNS)]
            biased += 1
        else:
            method, mesh = RUNS[1]
        marks = () if name in FAST else (pytest.mark.slow,)
        yield pytest.param(name, method, mesh, id=f"{name}-{method}", marks=marks)


@pytest.mark.parametrize("position, method, mesh", list(_schemes()))
def test_one_step_equals_single_or_is_refused(position, method, mesh):
    cfg = GPT.replace(position=position)
    refusal = shard_refusal(cfg)
    if refusal is not None:
        with pytest.raises(ConfigError, match=r"train.strategy='shard_map' with context=4: "
                           rf"position.*{position}.*use train.strategy=jit"):
            make_trainer("shard_map", build_model(cfg), optax.sgd(0.1), _batch(),
                         mesh="data=2,context=4")
        return
    _assert_same(_train(cfg, "shard_map", mesh, method), _train(cfg, "single"))


def test_refused_schemes_are_the_whole_sequence_ones():
    """Refused: what one shard cannot compute, a draw over the whole sequence or a rule of
    the window's length; the bias schemes run (built against every key's positions)."""
    refused = {n for n in POSITIONS.names() if shard_refusal(GPT.replace(position=n))}
    assert refused == {"randomized"}
    dynamic = GPT.replace(position={"name": "rope", "scaling": {
        "name": "dynamic_ntk", "factor": 2.0, "original_max_len": 16}})
    assert "takes its length from the whole window" in shard_refusal(dynamic)
    per_position = dynamic.replace(position={"name": "rope", "scaling": {
        "name": "dynamic_ntk", "factor": 2.0, "original_max_len": 16, "length": "position"}})
    assert shard_refusal(per_position) is None


@pytest.mark.parametrize("mask, extra, method, position", [
    pytest.param({"name": "sliding_window", "window": 6}, "packed", "ring_zigzag", "alibi",
                 marks=pytest.mark.slow),
    pytest.param("prefix", "prefix", "ring", "t5", marks=pytest.mark.slow),
    pytest.param("causal", "packed", "all_gather", "rope", marks=pytest.mark.slow),
])
def test_masks_one_step_equals_single(mask, extra, method, position):
    """Masks by positions through the shards: a window reaching over shard boundaries on
    packed documents (positions restarting: the bias too), prefixes ending in different
    shards (a bidirectional bias), causal packed documents."""
    cfg = GPT.replace(position=position, mask=mask)
    _assert_same(_train(cfg, "shard_map", "data=2,context=4", method, extra),
                 _train(cfg, "single", extra=extra))


@pytest.mark.slow
def test_bert_masked_lm_one_step_equals_single():
    """An encoder (bidirectional, T5's bidirectional bias) on its masked-LM objective."""
    cfg = GPT.replace(family="bert", mask="bidirectional", position="t5")
    objective = objective_for("bert")
    _assert_same(_train(cfg, "shard_map", "data=2,context=4", "ring", objective=objective),
                 _train(cfg, "single", objective=objective))


@pytest.mark.slow
def test_three_steps_equal_single():
    """Two layers, two micro-batches a step (local gradient sums, one all-reduce)."""
    cfg = GPT.replace(position="learned", n_layers=2)
    got = _train(cfg, "shard_map", "data=2,context=4", "ring_zigzag", steps=3, grad_accum=2)
    want = _train(cfg, "single", steps=3)
    assert got[0][2] < got[0][0]  # it learns
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)


def test_refusals_name_what_works():
    model, batch = build_model(GPT), _batch()
    with pytest.raises(ConfigError, match="'shard_map' splits only data and context.*'data=D,"
                       "context=C' \\(got fsdp=2\\); use train.strategy=jit to shard parameters"):
        make_trainer("shard_map", model, optax.sgd(0.1), batch, mesh="data=2,fsdp=2,context=2")
    with pytest.raises(ConfigError, match="'pmap' splits only data.*got context=4.*jit to "
                       "shard sequences \\(context; train.strategy=shard_map splits them too"):
        make_trainer("pmap", model, optax.sgd(0.1), batch, mesh="data=2,context=4")
    pallas = build_model(GPT.replace(attention="pallas"))  # the kernel's refusal, as under jit
    with pytest.raises(ConfigError, match="^attention='pallas' with context parallelism: the "
                       "all_gather method.*use train.context_attention=ring"):
        make_trainer("shard_map", pallas, optax.sgd(0.1), batch, mesh="data=2,context=4",
                     context_attention="all_gather")
    lstm = build_model(GPT.replace(family="lstm"))
    with pytest.raises(ConfigError, match="family=lstm reads the sequence through a recurrent "
                       "state.*use train.strategy=jit"):
        make_trainer("shard_map", lstm, optax.sgd(0.1), batch, mesh="data=2,context=4")


def test_a_length_that_does_not_split_is_refused_with_the_fix():
    trainer = make_trainer("shard_map", build_model(GPT), optax.sgd(0.1), _batch(),
                           mesh="data=2,context=4")
    odd = {k: v[:, :30] for k, v in _batch().items()}  # 30 tokens a row over 4 shards
    params = trainer.place_state(_initial_state(GPT)).params  # init_state's, built once
    with pytest.raises(ConfigError, match=r"batch\['inputs'\] has rows of 30 tokens, which do "
                       r"not split into context=4 .*a multiple of 4"):
        trainer.eval_step(params, odd)


def _cli_losses(run_dir, *flags) -> list[float]:
    """``tjax train`` in this process (8 fake devices): the train and eval losses it logs."""
    import json

    from transformers_jax import cli

    # no TensorBoard (its import and the greedy sample it logs are no part of the losses)
    assert cli.main(["train", "--model.d_model=32", "--model.n_layers=1", "--model.n_heads=4",
                     "--model.max_len=32", "--steps", "2", "--train.batch_size=4",
                     "--train.seq_len=32", "--train.log_every=1", "--train.eval_every=2",
                     "--train.eval_batches=1", "--train.tensorboard=false", "--no-progress",
                     "--run-dir", str(run_dir), *flags]) == 0
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r[k] for r in rows for k in ("loss", "eval_loss") if k in r]


@pytest.mark.slow
def test_cli_trains_as_single(tmp_path):
    """``tjax train --train.strategy=shard_map --train.mesh=data=2,context=4``: its training
    and evaluation losses are the single device's."""
    got = _cli_losses(tmp_path / "sharded", "--train.strategy=shard_map",
                      "--train.mesh=data=2,context=4", "--train.context_attention=ring")
    want = _cli_losses(tmp_path / "single", "--train.strategy=single")
    assert len(got) == len(want) >= 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
