"""Training: loss, schedule, FLOPs, a run whose loss falls, and the README main command."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import single_device_env

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.data.corpus import default_corpus, read_text
from transformers_jax.learning import flops
from transformers_jax.learning.flops import flops_per_token
from transformers_jax.learning.losses import lm_loss, predicts_target
from transformers_jax.learning.optim import decay_mask, learning_rate_schedule
from transformers_jax.train.loop import train

TINY_MODEL = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=32)


def test_lm_loss_of_uniform_logits_is_log_vocab():
    logits = jnp.zeros((2, 5, 7))
    targets = jnp.ones((2, 5), jnp.int32)
    loss, _ = lm_loss(logits, targets)
    assert float(loss) == pytest.approx(math.log(7), rel=1e-6)
    # weights select positions: a confident right answer at the only weighted position
    logits = logits.at[0, 0, 1].set(100.0)
    weights = jnp.zeros((2, 5)).at[0, 0].set(1.0)
    loss, acc = lm_loss(logits, targets, weights)
    assert float(loss) < 1e-6 and float(acc) == 1.0


def test_predicts_target_is_argmax_equals_target_with_ties():
    """The argmax-free accuracy agrees with ``argmax == target`` everywhere, ties included
    (argmax takes the first maximum): rows of few distinct values make ties common."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.integers(0, 3, (64, 9, 7)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, 7, (64, 9)))
    got = predicts_target(logits, targets)
    want = jnp.argmax(logits, -1) == targets
    np.testing.assert_array_equal(got, want)
    assert 0 < int(got.sum()) < got.size  # both outcomes occur
    uniform = predicts_target(jnp.zeros((1, 3, 5)), jnp.array([[0, 2, 4]]))
    assert uniform.tolist() == [[True, False, False]]  # all tied: only id 0 is the argmax


def test_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == pytest.approx(0.1)  # never zero on the first update
    assert float(lr(9)) == pytest.approx(1.0)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(55)) == pytest.approx(0.55, abs=1e-6)  # half-way down the cosine
    assert float(lr(100)) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    mask = decay_mask({"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3), "scale": jnp.ones(3)})
    assert mask == {"kernel": True, "bias": False, "scale": False}


def test_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, d_ff=16)
    # per layer: q,k,v,o 4*8*8 + mlp 2*8*16 = 512 MACs; head 8*10; attention 2*T*8
    macs = 2 * 512 + 80 + 2 * 2 * 4 * 8
    assert flops_per_token(cfg, seq_len=4, training=False) == 2 * macs
    assert flops_per_token(cfg, seq_len=4) == 6 * macs
    # BERT's masked-LM head has an 8 x 8 transform before the output matrix
    bert = cfg.replace(family="bert", mask={"name": "bidirectional"})
    assert flops_per_token(bert, seq_len=4, training=False) == 2 * (macs + 8 * 8)


def test_flops_per_token_both_attention_conventions_by_hand():
    """Full context (ours, PaLM's) against causal attention at half (MaxText's since its PR
    #1988), worked by hand for a tiny config at T = 16."""
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, d_ff=16)  # H=2, D=4
    T = 16
    weights = 2 * (2 * 512 + 80)  # FLOPs per token: 2 layers of q,k,v,o + MLP; the head
    # per token and layer, QK^T and AV are 2*T*H*D = 256 FLOPs each: 512 per layer
    full_attention = 2 * (256 + 256)  # two layers
    half_attention = 2 * 256  # causal: a query sees T/2 keys on average
    assert flops_per_token(cfg, T, training=False) == weights + full_attention == 3232
    assert flops_per_token(cfg, T, training=False, causal_half=True) == 2720
    assert 2720 == weights + half_attention
    assert flops_per_token(cfg, T, causal_half=True) == 3 * 2720  # training: x3
    # not causal: both conventions agree (bert's bidirectional mask; + its 8x8 head transform)
    bert = cfg.replace(family="bert", mask={"name": "bidirectional"})
    assert (flops_per_token(bert, T, causal_half=True)
            == flops_per_token(bert, T) == 3 * (3232 + 2 * 64))
    # a sliding window is causal: halved too (the window itself is not modelled)
    window = cfg.replace(mask={"name": "sliding_window", "window": 4})
    assert flops_per_token(window, T, training=False, causal_half=True) == 2720
    # encoder-decoder: only the decoder's self-attention is causal (2 layers x 256 FLOPs
    # saved); the encoder's self-attention and the cross-attention stay full
    encdec = cfg.replace(family="encdec")
    full = flops_per_token(encdec, T, training=False)
    assert full - flops_per_token(encdec, T, training=False, causal_half=True) == 2 * 256


def test_the_peak_is_the_users_figure_or_a_measured_matmul(monkeypatch):
    monkeypatch.setenv(flops.PEAK_ENV, "1.97e14")
    assert flops.device_peak() == (1.97e14, "TJAX_PEAK_FLOPS")
    for bad in ("fast", "0", "-1e12", "nan", "inf"):
        monkeypatch.setenv(flops.PEAK_ENV, bad)
        with pytest.raises(ValueError, match=f"TJAX_PEAK_FLOPS={bad!r}.*positive number"):
            flops.device_peak()
    monkeypatch.delenv(flops.PEAK_ENV)
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype: {"float32": 2e11}[dtype])
    assert flops.device_peak() == (2e11, "measured float32 matmul on cpu")


def test_corpus_errors_and_default(tmp_path):
    assert len(default_corpus()) > 400_000
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_text(str(tmp_path / "empty.txt"))


@pytest.mark.slow
def test_loss_falls_on_a_learnable_corpus(tmp_path):
    # A fixed cycle of 23 symbols: fully predictable from one token of context. 60 steps at
    # 1e-2 end at an eval loss of about 0.065 (120 steps at 3e-3 ended at 0.286, just under
    # the bound); the run's compiles, not its steps, are what it costs.
    path = tmp_path / "cycle.txt"
    path.write_text("the quick brown fox jumps " * 400)
    cfg = TrainConfig(steps=60, batch_size=8, seq_len=32, warmup_steps=5, log_every=5,
                      eval_every=60, eval_batches=2, data=str(path), progress=False,
                      learning_rate=1e-2)
    final = train(TINY_MODEL, cfg)
    first = final["history"][0]["loss"]
    assert first > 4.0, first  # about log(262) = 5.57 at the start
    assert final["eval_loss"] < 0.3, final["eval_loss"]
    assert final["tokens_per_s"] > 0 and 0 < final["mfu"] < 1


@pytest.mark.slow
def test_same_seed_same_losses(tmp_path):
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=16, warmup_steps=1, log_every=1,
                      eval_every=6, eval_batches=1, progress=False, run_dir=str(tmp_path))
    model = TINY_MODEL.replace(dropout=0.1)
    a = [h["loss"] for h in train(model, cfg)["history"]]
    b = [h["loss"] for h in train(model, cfg.replace(run_dir=None))["history"]]
    assert a == b and len(a) == 6
    c = [h["loss"] for h in train(model, cfg.replace(seed=1, run_dir=None))["history"]]
    assert a != c
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert {"start", "train", "eval", "final"} <= {row["kind"] for row in lines}


def tjax(*args, timeout=300):
    exe = os.path.join(os.path.dirname(sys.executable), "tjax")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "transformers_jax.cli"]
    env = single_device_env()
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
def test_readme_main_command_at_a_tiny_step_count():
    result = tjax("train", "--steps", "4", "--train.warmup_steps=1", "--train.log_every=2",
                  "--train.eval_batches=1", "--model.n_layers=1", "--model.d_model=32",
                  "--json")
    assert result.returncode == 0, result.stderr
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert final["steps"] == 4 and final["eval_loss"] < 6.0
    assert "tokens/s" in result.stderr and "MFU" in result.stderr
    # stderr is a pipe: plain log lines, no progress-bar frames redrawn with carriage returns
    assert "\r" not in result.stderr and "it/s]" not in result.stderr


def test_cli_errors_are_clear(capsys, tmp_path):
    """The executable exits with status 2 and says why (one process: the exit path); the
    second error goes through the same ``cli.main`` in this process (its return value is the
    exit status), sparing a second start of JAX."""
    from transformers_jax import cli

    result = tjax("train", "--data", "/nonexistent/corpus.txt")
    assert result.returncode == 2
    assert "no such file, folder or glob" in result.stderr
    assert cli.main(["train", "--model.n_heads=3"]) == 2
    assert "must divide d_model=128" in capsys.readouterr().err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert cli.main(["train", "--run-dir", str(a_file), "--steps", "1"]) == 2
    assert f"train.run_dir={a_file}: a file, and a run directory is a folder" in \
        capsys.readouterr().err
    assert a_file.read_text() == "mine"


@pytest.mark.slow
def test_trained_tokenizer_is_saved_with_the_run_and_restored(tmp_path):
    from transformers_jax.runs import load_run

    run = str(tmp_path / "run")
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, log_every=1, eval_every=2,
                      eval_batches=1, progress=False, run_dir=run, tokenizer="char")
    final = train(TINY_MODEL, cfg, auto_vocab=True)
    assert final["steps"] == 2
    _, _, tokenizer, config = load_run(run)
    assert tokenizer.name == "char" and config.vocab_size == tokenizer.vocab_size < 262
    text = "def f(x): return x"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_run_tokenizer_builds_when_another_process_is_still_saving(tmp_path):
    """Two processes of a run share its directory: one may see ``tokenizer/`` before the other
    has written ``tokenizer.json`` into it. That half-saved directory is not read (it failed
    a two-process run with "no tokenizer saved"): the tokenizer is built and saved, then
    restored by the next call."""
    from transformers_jax.data.tokenizers import TOKENIZER_FILE
    from transformers_jax.runs.layout import TOKENIZER_DIR
    from transformers_jax.runs.tokenizer import training_tokenizer

    (tmp_path / TOKENIZER_DIR).mkdir()  # the other process has made the folder, no file yet
    cfg = TrainConfig(run_dir=str(tmp_path), tokenizer="byte")
    first = training_tokenizer(cfg)
    assert first.name == "byte" and (tmp_path / TOKENIZER_DIR / TOKENIZER_FILE).is_file()
    again = training_tokenizer(cfg)  # now restored from the file
    assert again.name == "byte" and again.vocab_size == first.vocab_size
    assert not list((tmp_path / TOKENIZER_DIR).glob("*.tmp*"))  # no temporary file left


@pytest.mark.slow
def test_prefix_lm_on_text_and_a_synthetic_task_train():
    prefix = TrainConfig(steps=3, batch_size=2, seq_len=16, log_every=1, eval_every=3,
                         eval_batches=1, progress=False)
    assert train(TINY_MODEL.replace(mask="prefix"), prefix)["steps"] == 3
    task = prefix.replace(task="reverse", train_lengths=(1, 5), seq_len=16)
    final = train(TINY_MODEL, task)
    assert final["steps"] == 3 and final["eval_loss"] is not None


SMALL_RUN = ["--train.batch_size=2", "--train.seq_len=16", "--train.eval_batches=1",
             "--no-progress"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 2-step run of TINY_MODEL made by ``tjax train`` with model flags (the start of both
    init_from tests): (its folder, its params, its model config)."""
    from transformers_jax import cli
    from transformers_jax.runs import load_run

    base = str(tmp_path_factory.mktemp("init_from") / "base")
    assert cli.main(["train", "--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2",
                     "--model.max_len=32", "--steps", "2", "--run-dir", base, *SMALL_RUN]) == 0
    _, params, _, config = load_run(base)
    assert config == TINY_MODEL
    return base, params, config


@pytest.mark.slow
def test_init_from_another_run_fine_tunes_with_new_settings(tmp_path, base_run):
    from transformers_jax.runs import load_run

    base, base_params, _ = base_run
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, log_every=1, eval_every=2,
                      eval_batches=1, progress=False)
    longer = TINY_MODEL.replace(position={"name": "rope", "scaling": {
        "name": "yarn", "factor": 2.0, "original_max_len": 16}})
    tuned = cfg.replace(run_dir=str(tmp_path / "tuned"), init_from=base, seq_len=32,
                        learning_rate=1e-9, steps=1, warmup_steps=0)
    final = train(longer, tuned)
    _, params, _, config = load_run(tuned.run_dir)
    assert config.position.scaling.name == "yarn" and final["steps"] == 1
    # a vanishing learning rate: the fine-tuned params are the base params (nearly)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, base_params)
    with pytest.raises(ValueError, match="do not have the shapes"):
        train(TINY_MODEL.replace(n_layers=2), cfg.replace(run_dir=None, init_from=base))


@pytest.mark.slow
def test_init_from_takes_the_model_from_the_run_it_starts_from(tmp_path, capsys, base_run):
    """``tjax train --train.init_from=RUN`` with no model flags trains RUN's model from RUN's
    params; --model.* overrides apply on top and are listed; a misfit names the field."""
    from transformers_jax import cli
    from transformers_jax.runs import load_run

    (base, base_params, base_cfg), tuned = base_run, str(tmp_path / "tuned")
    small = SMALL_RUN
    capsys.readouterr()
    assert cli.main(["train", "--train.init_from", base, "--model.dropout=0.1", "--steps", "1",
                     "--train.learning_rate=1e-9", "--train.warmup_steps=0", "--run-dir",
                     tuned, *small]) == 0
    assert f"model differs from {base}: dropout 0.0 -> 0.1" in capsys.readouterr().err
    _, params, _, config = load_run(tuned)
    assert config == base_cfg.replace(dropout=0.1)
    # a vanishing learning rate: the first update leaves the base run's params (nearly)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, base_params)
    assert cli.main(["train", "--train.init_from", base, "--model.n_layers=2", "--steps", "1",
                     *small]) == 2
    err = capsys.readouterr().err
    assert "do not have the shapes" in err and "n_layers 1 -> 2" in err, err


@pytest.mark.slow
def test_bert_and_encdec_train_through_the_same_loop(tmp_path):
    from transformers_jax.runs import load_run

    common = dict(steps=3, batch_size=4, seq_len=24, log_every=1, eval_every=3,
                  eval_batches=1, progress=False)
    bert = ModelConfig(family="bert", mask="bidirectional", d_model=32, n_layers=1, n_heads=2)
    final = train(bert, TrainConfig(run_dir=str(tmp_path / "bert"), **common))
    assert final["steps"] == 3 and 0 < final["eval_accuracy"] <= 1
    model, params, tokenizer, config = load_run(str(tmp_path / "bert"))
    assert config.family == "bert" and "mlm_head" in params

    encdec = ModelConfig(family="encdec", position="t5", d_model=32, n_layers=1, n_heads=2)
    final = train(encdec, TrainConfig(task="reverse", train_lengths=(1, 6),
                                      run_dir=str(tmp_path / "encdec"), **common))
    assert final["steps"] == 3
    assert load_run(str(tmp_path / "encdec"))[3].family == "encdec"
    with pytest.raises(ValueError, match="pass --task reverse"):
        train(encdec, TrainConfig(**common))
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig(family="encdec", mask="bidirectional")


STEP_MODEL = TINY_MODEL.replace(n_heads=2, n_kv_heads=2)
STEP_CFG = TrainConfig(steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=3,
                       eval_batches=1, progress=False)


@pytest.fixture(scope="module")
def one_device_run():
    """The 3-step one-device run the strategies and the row groups are held to (trained once),
    and the row-group counts the CPU backend was asked for while it trained."""
    from transformers_jax.backends import cpu

    calls = []
    real = cpu.row_group
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "row_group",
                      lambda batch, groups, index: calls.append(groups) or
                      real(batch, groups, index))
        final = train(STEP_MODEL, STEP_CFG)
    return final, calls


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mesh", [("pmap", None), ("jit", "data=2,fsdp=2,tensor=2")])
def test_loop_strategies_match_one_device(strategy, mesh, one_device_run):
    single, _ = one_device_run
    sharded = train(STEP_MODEL, STEP_CFG.replace(strategy=strategy, mesh=mesh))
    np.testing.assert_allclose([h["loss"] for h in sharded["history"]],
                               [h["loss"] for h in single["history"]], rtol=1e-5)
    assert sharded["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_loop_trains_with_concurrent_groups(monkeypatch, one_device_run):
    """``tjax train --train.concurrent_groups=2`` reaches the step (each traced step splits
    its batch into two row groups, the CPU backend's) and trains as the whole batch does
    (dropout 0)."""
    from transformers_jax.backends import cpu

    whole, whole_calls = one_device_run  # one group: the backend was never asked to split
    assert whole_calls == []
    calls = []
    real = cpu.row_group
    monkeypatch.setattr(cpu, "row_group",
                        lambda batch, groups, index: calls.append(groups) or
                        real(batch, groups, index))
    grouped = train(STEP_MODEL, STEP_CFG.replace(concurrent_groups=2))
    assert calls and set(calls) == {2} and len(calls) % 2 == 0
    np.testing.assert_allclose([h["loss"] for h in grouped["history"]],
                               [h["loss"] for h in whole["history"]], rtol=1e-5)


def test_resume_reads_an_older_checkpoint_as_one_group():
    """A checkpoint written before ``concurrent_groups`` existed ran with one group: resuming
    it at the default warns of nothing, resuming it with two groups says so."""
    from transformers_jax.runs.meta import train_differences

    older = {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k != "concurrent_groups"}
    assert train_differences(older, TrainConfig()) == []
    diffs = train_differences(older, TrainConfig(concurrent_groups=2))
    assert diffs == ["concurrent_groups: checkpoint has 1, asked for 2"]
    # nor does a checkpoint from before LoRA: it trained every parameter
    before_lora = {k: v for k, v in dataclasses.asdict(TrainConfig()).items()
                   if k not in ("lora", "data_download")}
    assert train_differences(before_lora, TrainConfig()) == []
    assert train_differences(before_lora, TrainConfig(lora={"rank": 4}))[0].startswith("lora.")


@pytest.mark.slow
def test_a_family_declares_its_inputs_in_its_entry(monkeypatch):
    """A new family is its module and its registered ``Family`` entry: the objective it names
    applies the model with the inputs the entry declares, and nothing in ``train/`` names the
    family. Here a toy LM that takes positions and nothing else trains a step on a batch that
    also carries segments (which GPT's inputs would pass, and the toy would refuse)."""
    import flax.linen as nn

    from transformers_jax.learning.objectives import objective_for, run_objective
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.learning.step import init_state, make_train_step
    from transformers_jax.models import FAMILIES, Family

    given = []

    class Toy(nn.Module):
        config: ModelConfig

        @nn.compact
        def __call__(self, tokens_BT, *, positions, deterministic=True):
            given.append(positions.shape)
            x_BTC = nn.Embed(self.config.vocab_size, 8)(tokens_BT + positions % 2)
            return nn.Dense(self.config.vocab_size)(x_BTC).astype(jnp.float32)

    monkeypatch.setitem(FAMILIES._entries, "toy", Family(Toy, objective="lm",
                                                         input_keys=("positions",)))
    config = ModelConfig(family="toy", vocab_size=16)
    assert objective_for("toy").input_keys == ("positions",) == run_objective(config).input_keys
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 16
    batch = {"inputs": tokens, "targets": tokens, "positions": jnp.tile(jnp.arange(6), (2, 1)),
             "segment_ids": jnp.ones((2, 6), jnp.int32)}
    objective, optimizer = objective_for("toy"), make_optimizer(TrainConfig())
    state = init_state(Toy(config), optimizer, 0, batch, objective)
    _, metrics = make_train_step(Toy(config), optimizer, objective=objective)(state, batch)
    assert np.isfinite(float(metrics["loss"])) and given and set(given) == {(2, 6)}
