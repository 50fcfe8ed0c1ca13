"""LoRA (learning/lora.py): the folded forward pass equals the adapters applied beside each
projection, only the adapters train, a LoRA run checkpoints adapters only and resumes exactly,
merge gives a plain run with the same logits, and bad input names the fix."""

from __future__ import annotations

import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from transformers_jax.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from transformers_jax.convert.api import export_class
from transformers_jax.convert.merge import merge_lora_run
from transformers_jax.learning import lora
from transformers_jax.learning.objectives import objective_for
from transformers_jax.learning.optim import make_optimizer
from transformers_jax.models import build_model
from transformers_jax.nn.layers import Dense
from transformers_jax.parallel.strategies import make_trainer
from transformers_jax.runs.load import open_run
from transformers_jax.train.loop import train

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64)
BOTH = LoraConfig(rank=3, alpha=6.0, targets=("attention", "mlp"))


def batch_of(seed: int = 0, rows: int = 4, length: int = 16) -> dict:
    x = np.random.RandomState(seed).randint(0, 64, (rows, length)).astype(np.int32)
    return {"inputs": x, "targets": np.roll(x, -1, axis=1)}


def random_adapters(model: lora.LoraModel, seed: int = 1) -> dict:
    """Params with B non-zero, so the adapters change every target."""
    params = nn.meta.unbox(
        model.init(jax.random.key(0), jnp.asarray(batch_of()["inputs"]))["params"]
    )
    leaves, tree = jax.tree.flatten(params[lora.LORA])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return {lora.BASE: params[lora.BASE], lora.LORA: jax.tree.unflatten(tree, noisy)}


def adapter_path_logits(model: lora.LoraModel, params: dict, x) -> jax.Array:
    """peft's form, the independent reference: the base model with ``scale * (x @ A) @ B``
    added to each targeted projection's output, on the activations (nothing folded)."""
    adapters, scale = params[lora.LORA], model.scale

    def add_adapter(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        module = context.module
        if not (isinstance(module, Dense) and context.method_name == "__call__"):
            return y
        node = adapters
        for key in module.path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return y
        x_in = args[0]
        n_in = math.prod(x_in.shape[x_in.ndim - module.in_dims :])
        a = node["a"].reshape(n_in, -1)
        b = node["b"].reshape(a.shape[1], -1)
        low = (x_in.reshape(-1, n_in) @ a) @ b
        return y + scale * low.reshape(y.shape)

    with nn.intercept_methods(add_adapter):
        return model.plain().apply({"params": params[lora.BASE]}, x)


@pytest.mark.slow
def test_folded_forward_equals_adapters_beside_the_projections():
    """Every target kind (q/k/v with GQA, the out projection's two input dims, MLP up/down)."""
    model = lora.wrap(build_model(TINY), BOTH)
    assert {t.path[-1] for t in model.targets} == {"query", "key", "value", "out", "up", "down"}
    params = random_adapters(model)
    x = jnp.asarray(batch_of()["inputs"])
    folded = model.apply({"params": params}, x)
    beside = adapter_path_logits(model, params, x)
    plain = model.plain().apply({"params": params[lora.BASE]}, x)
    assert float(jnp.abs(folded - plain).max()) > 1e-2  # the adapters do something
    np.testing.assert_allclose(folded, beside, rtol=2e-5, atol=2e-5)
    # merged params in the plain model: the very same logits
    merged = model.plain().apply({"params": model.merged(params)}, x)
    np.testing.assert_array_equal(merged, folded)


@pytest.mark.slow
def test_fresh_adapters_leave_the_model_as_it_was_also_scanned():
    for cfg in (TINY, TINY.replace(scan_layers=True)):
        model = lora.wrap(build_model(cfg), LoraConfig(rank=2))
        x = jnp.asarray(batch_of()["inputs"])
        params = model.init(jax.random.key(0), x)["params"]
        out = model.apply({"params": params}, x)
        base = model.plain().apply({"params": nn.meta.unbox(params[lora.BASE])}, x)
        np.testing.assert_array_equal(out, base)
        # scanned: adapters carry the stacked layer axis, A [L, C, R], B [L, R, H, D]
        q = params[lora.LORA]["layers" if cfg.scan_layers else "layer_0"]["attention"]["query"]
        lead = (2,) if cfg.scan_layers else ()
        assert nn.meta.unbox(q["a"]).shape == (*lead, 32, 2)
        assert nn.meta.unbox(q["b"]).shape == (*lead, 2, 4, 8)


@pytest.mark.slow
def test_only_adapters_train_and_the_loss_falls():
    model = lora.wrap(build_model(TINY), BOTH)
    cfg = TrainConfig(lora=BOTH, init_from="x", learning_rate=3e-2, warmup_steps=0, steps=30)
    batch = batch_of()
    trainer = make_trainer(
        "single", model, make_optimizer(cfg), batch, objective=objective_for("gpt")
    )
    state = trainer.init_state(0)
    base0 = jax.tree.map(np.asarray, state.params[lora.BASE])
    lora0 = jax.tree.map(np.asarray, state.params[lora.LORA])
    # Adam's moments exist for the adapters alone
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == 2 * lora.trainable_count(state.params)
    assert lora.trainable_count(state.params) < count(state.params[lora.BASE]) / 4
    losses = []
    for _ in range(30):
        state, metrics = trainer.step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.2, losses  # one batch memorised through the adapters
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(state.params[lora.BASE]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(lora0), jax.tree.leaves(state.params[lora.LORA]), strict=True
        )
    )


def count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


SMALL = dict(
    batch_size=4,
    seq_len=32,
    eval_every=100,
    eval_batches=1,
    log_every=100,
    progress=False,
    tensorboard=False,
    learning_rate=1e-2,
)
GPT = ModelConfig(n_layers=1, d_model=32, n_heads=2)


def array_bytes(state_dir: str) -> int:
    """Bytes of the arrays an orbax checkpoint item stores, from its metadata."""
    meta = ocp.StandardCheckpointer().metadata(state_dir)
    tree = getattr(meta, "item_metadata", meta)
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


@pytest.mark.slow
def test_lora_run_saves_adapters_resumes_exactly_and_merges(tmp_path, capsys):
    base = str(tmp_path / "base")
    train(GPT, TrainConfig(steps=4, run_dir=base, **SMALL), auto_vocab=True)
    cfg = TrainConfig(steps=6, schedule_steps=6, init_from=base, lora=LoraConfig(rank=2), **SMALL)
    capsys.readouterr()
    train(GPT, cfg.replace(run_dir=str(tmp_path / "straight")), auto_vocab=True)
    # the start line and record name the trainable (adapter) and frozen parameters
    rows = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    start = next(row for row in rows if row["kind"] == "start")
    adapters = 1 * 2 * (2 * (32 + 32) + 2 * (32 + 32))  # layers x rank x (q, o, k, v: C + HD)
    assert start["trainable_params"] == adapters == 512
    frozen = start["params"] - adapters
    assert frozen == count(open_run(base).params)
    assert (
        f"(512 trainable: LoRA rank 2 on query,key,value,out, {frozen:,} frozen)"
        in capsys.readouterr().err
    )
    split = str(tmp_path / "split")
    train(GPT, cfg.replace(run_dir=split, steps=3), auto_vocab=True)
    train(GPT, cfg.replace(run_dir=split), auto_vocab=True)  # resumed at step 3

    straight, resumed = open_run(str(tmp_path / "straight")), open_run(split)
    assert straight.step == resumed.step == 6
    assert straight.meta["lora_base"] == {"run": os.path.abspath(base), "step": 4}
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    # the checkpoint holds the adapters and their moments, not the model. Measured on the stored
    # arrays: the folder's size is mostly orbax's per-leaf metadata and varies with write timing
    stored = array_bytes(os.path.join(split, "checkpoints", "6", "state"))
    assert stored < array_bytes(os.path.join(base, "checkpoints", "4", "state")) / 20
    assert stored >= 3 * 4 * adapters  # the adapters and both Adam moments, float32
    # merged: a plain run whose logits are the LoRA run's
    merged_dir = str(tmp_path / "merged")
    merge_lora_run(split, merged_dir)
    merged = open_run(merged_dir)
    # a run of its own: at the adapters' step, with their data (tjax eval scores the same
    # held-out text), its settings less the adapters, a README naming its lineage
    assert merged.step == 6 and not merged.train_config.lora.enabled
    assert merged.train_config.init_from is None and merged.meta["data"] == resumed.meta["data"]
    assert merged.train_config.replace(lora=cfg.lora, init_from=base, run_dir=split) \
        == resumed.train_config
    readme = open(os.path.join(merged_dir, "README.md")).read()
    assert f"adapters of the LoRA run `{os.path.abspath(split)}` at step 6 (rank 2" in readme
    assert f"`{os.path.abspath(base)}` at step 4" in readme and "tokens/s" not in readme
    # the export suggested where the converter takes the model; never for the adapters' run
    assert ("tjax convert --to-hf" in readme) == (export_class(merged.config) is not None)
    assert "tjax convert" not in open(os.path.join(split, "README.md")).read()
    saved = json.load(open(os.path.join(merged_dir, "tjax_config.json")))
    assert saved["train"]["lora"]["rank"] is None and saved["model"]["n_layers"] == 1
    x = jnp.asarray(batch_of(length=8)["inputs"] % 200)
    np.testing.assert_array_equal(
        merged.model.apply({"params": merged.params}, x),
        resumed.model.apply({"params": resumed.params}, x),
    )
    base_run = open_run(base)
    assert (
        float(
            jnp.abs(
                base_run.model.apply({"params": base_run.params}, x)
                - merged.model.apply({"params": merged.params}, x)
            ).max()
        )
        > 0
    )
    with pytest.raises(ValueError, match="not trained with --train.lora.rank"):
        merge_lora_run(base, str(tmp_path / "again"))


def test_bad_input_is_named():
    x = {"inputs": jnp.zeros((1, 8), jnp.int32)}
    with pytest.raises(ConfigError, match="'qkv' matches no projection.*query"):
        lora.with_lora(build_model(TINY), LoraConfig(rank=2, targets=("qkv",)), x, {})
    lstm = build_model(ModelConfig(family="lstm", d_model=32, vocab_size=64))
    with pytest.raises(ConfigError, match="has no projection LoRA can adapt"):
        lora.with_lora(lstm, LoraConfig(rank=2), x, {})
    with pytest.raises(ConfigError, match="train.lora.rank=0: must be a positive"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="train.lora.alpha=.*needs train.lora.rank"):
        LoraConfig(alpha=16.0)
    with pytest.raises(ConfigError, match="--train.init_from"):
        train(GPT, TrainConfig(steps=2, lora=LoraConfig(rank=2), **SMALL))


@pytest.mark.slow
def test_llama_3_2_1b_memory_count():
    """Adam state for the adapters only: rank 16 on q, k, v, o is 3.4M parameters (by hand:
    per layer r(C + HD) + 2 r(C + ND) + r(HD + C), 16 layers), and the persistent state drops
    from 4x the bfloat16 weights (9.2 GiB) to 2.33 GiB, which fits a 15 GB Colab T4."""
    cfg = ModelConfig.preset("llama-3.2-1b").replace(param_dtype="bfloat16")
    got = lora.memory_count(build_model(cfg), LoraConfig(rank=16))
    r, c, hd, nd = 16, 2048, 32 * 64, 8 * 64
    assert got["params"] == 1_235_814_400
    assert got["adapter_params"] == 16 * (r * (c + hd) + 2 * r * (c + nd) + r * (hd + c))
    assert got["full_finetune_bytes"] == 4 * 2 * 1_235_814_400
    assert got["lora_bytes"] == 2 * 1_235_814_400 + 4 * 2 * got["adapter_params"]
    assert got["lora_bytes"] + got["lora_step_extra_bytes"] < 15e9 / 4
