"""LoRA on a converted Hugging Face model, end to end through the CLI: a tiny Llama built by
``transformers`` (random weights, no download) is converted, fine-tuned with
``--train.lora.rank`` until its loss falls, merged with ``tjax merge``, and exported with
``convert --to-hf``; the merged run's logits are the LoRA step's own forward pass (base plus
adapters, folded as training folds them), and ``transformers`` reading the export gives the
same logits to 1e-4 (float32 on both sides, as tests/test_convert.py's parity)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_cli_journeys import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers_jax.learning import lora  # noqa: E402
from transformers_jax.runs.checkpoint import Checkpointer, abstract_like  # noqa: E402
from transformers_jax.runs.load import open_run, state_target  # noqa: E402

ATOL = 1e-4  # |logit difference| between transformers and us, float32 (test_convert's)


def tiny_llama(directory) -> str:
    """GQA Llama, vocabulary 262: the byte tokenizer's, so the converted run reads text."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=262, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return str(directory)


def lora_forward(run_dir: str, tokens: np.ndarray) -> np.ndarray:
    """The LoRA run's training forward pass: its ``LoraModel`` on ``{base: the base run's
    params, lora: the adapters as checkpointed}``, nothing merged beforehand."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.pick(None)
        meta = ckpt.read_meta(step)
        run = open_run(run_dir, step)  # for its config and objective
        model, target = state_target(run.config, run.train_config, run.objective)
        state, _ = ckpt.restore(abstract_like(target), step)
    finally:
        ckpt.close()
    assert isinstance(model, lora.LoraModel)
    base = open_run(meta["lora_base"]["run"], meta["lora_base"]["step"]).params
    params = {lora.BASE: base, lora.LORA: state.params[lora.LORA]}
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))


@pytest.mark.slow
def test_lora_fine_tune_of_a_converted_llama_merges_and_exports(tmp_path):
    source = tiny_llama(tmp_path / "hf")
    base, tuned, merged, export = (str(tmp_path / d) for d in ("base", "lora", "merged", "out"))
    assert run_cli(["convert", "--from-hf", source, "--out", base]) == (0, "")
    code, err = run_cli([
        "train", f"--train.init_from={base}", "--train.lora.rank=4", "--train.lora.alpha=8",
        "--run-dir", tuned, "--steps", "12", "--train.batch_size=4", "--train.seq_len=32",
        "--train.learning_rate=2e-2", "--train.warmup_steps=0", "--train.log_every=1",
        "--train.eval_every=100", "--train.eval_batches=1", "--no-progress",
        "--train.tensorboard=false"])  # fmt: skip
    assert code == 0, err
    assert "trainable: LoRA rank 4 on query,key,value,out" in err
    losses = [r["loss"] for r in map(json.loads, open(f"{tuned}/metrics.jsonl"))
              if r["kind"] == "train"]  # fmt: skip
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses

    assert run_cli(["merge", "--run", tuned, "--out", merged])[0] == 0
    tokens = np.random.default_rng(1).integers(0, 262, (2, 24))
    run = open_run(merged)
    ours = np.asarray(run.model.apply({"params": run.params}, jnp.asarray(tokens)))
    # the merge is the very fold the step applies: the same numbers, not merely close
    np.testing.assert_array_equal(ours, lora_forward(tuned, tokens))
    start = open_run(base)
    moved = np.abs(ours - np.asarray(start.model.apply({"params": start.params}, tokens)))
    assert moved.max() > 0.1  # the adapters changed the model

    assert run_cli(["convert", "--to-hf", export, "--run", merged])[0] == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        theirs = exported.eval()(torch.as_tensor(tokens)).logits.numpy()
    assert theirs.std() > 0.1  # logits big enough for an absolute tolerance to mean something
    assert np.max(np.abs(theirs - ours)) < ATOL
    assert json.load(open(f"{export}/config.json"))["num_key_value_heads"] == 2
