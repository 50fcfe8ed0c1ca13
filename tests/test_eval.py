"""``tjax eval`` on tiny trained runs: the loss equals the training loop's last eval on the
same held-out batches, bits and perplexity follow from it, the loss-by-position PNG exists,
passkey accuracy is scored against the right keys, and bad requests fail with a fix."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
from subprocess_env import single_device_env

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.evaluation import evaluate_run, passkey_needle, passkey_prompt
from transformers_jax.train.loop import train

TINY = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=256)


def tiny_run(run_dir, model=TINY, **kw) -> str:
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=32, warmup_steps=1, log_every=3,
                      eval_every=3, eval_batches=2, progress=False, run_dir=str(run_dir),
                      tensorboard=False, **kw)
    train(model, cfg)
    return str(run_dir)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("eval") / "gpt")


def tjax(*args):
    exe = os.path.join(os.path.dirname(sys.executable), "tjax")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "transformers_jax.cli"]
    env = single_device_env()
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_loss_equals_the_last_eval_of_the_training_loop(gpt_run, tmp_path):
    png = str(tmp_path / "curve.png")
    result = evaluate_run(gpt_run, lengths=[16, 32], plot=png, passkey=True,
                          passkey_lengths=[128, 160])
    last_eval = [json.loads(x) for x in open(os.path.join(gpt_run, "metrics.jsonl"))
                 if json.loads(x)["kind"] == "eval"][-1]
    assert result["step"] == 6 and result["seq_len"] == 32 and result["batches"] == 2
    assert math.isfinite(result["loss"])
    assert result["loss"] == pytest.approx(last_eval["loss"], rel=1e-5, abs=1e-6)
    assert result["unit"] == "byte" and "bits_per_token" not in result
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2))
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert [e["length"] for e in result["by_length"]] == [16, 32]
    at_32 = result["by_length"][1]
    assert at_32["loss"] == result["loss"]
    curve = at_32["loss_by_position"]
    assert len(curve) == 32 and all(math.isfinite(x) for x in curve)
    assert len(result["by_length"][0]["loss_by_position"]) == 16
    assert result["plot"] == png and os.path.getsize(png) > 1000
    # passkey: one cell per length and depth, scored by exact match of the right key
    cells = result["passkey"]["cells"]
    assert {(c["length"], c["depth"]) for c in cells} == {(n, d) for n in (128, 160)
                                                           for d in (0.0, 0.5, 1.0)}
    keys = [t["key"] for c in cells for t in c["trials"]]
    assert len(set(keys)) > 1 and all(re.fullmatch(r"[1-9]\d{4}", k) for k in keys)
    for c in cells:
        assert 0.0 <= c["accuracy"] <= 1.0 and len(c["trials"]) == 4
        for t in c["trials"]:
            found = re.match(r"\s*(\d+)", t["answer"])
            assert t["correct"] == bool(found and found.group(1) == t["key"])
        assert c["accuracy"] == pytest.approx(sum(t["correct"] for t in c["trials"]) / 4)
    json.dumps(result)  # JSON-ready


@pytest.mark.slow
def test_data_given_as_local_text_is_evaluated_whole(gpt_run, tmp_path):
    """--data FILE is not the run's training text: all of it is read, even one short document
    (the held-out 5% of it would be one piece or none)."""
    text = tmp_path / "one.txt"
    text.write_bytes(b"a small file of text to evaluate on, in one piece. " * 3)
    result = evaluate_run(str(gpt_run), data=str(text), lengths=[16], batches=1, plot=None)
    assert result["split"] == "all of --data" and math.isfinite(result["loss"])
    own = evaluate_run(str(gpt_run), lengths=[16], batches=1, plot=None)
    assert own["split"] == "held-out" and own["loss"] != result["loss"]


def test_passkey_prompt_hides_the_key_at_the_depth():
    from transformers_jax.data.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tok, "12345", 300, depth)
        text = tok.decode(ids)
        assert len(ids) == 300 and text.endswith("What is the pass key? The pass key is")
        at = text.index(passkey_needle("12345"))
        assert abs(at / (300 - len(passkey_needle("12345")) - 37) - depth) < 0.02
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, "12345", 40, 0.5)


@pytest.mark.slow
def test_cli_prints_a_summary_and_writes_every_figure_out(gpt_run, tmp_path):
    """A person reads a few lines and a table; ``--out`` (and ``--json``, tested with random
    options in test_fuzz) has every figure, the same ones the summary rounds."""
    out = tmp_path / "eval.json"
    result = tjax("eval", "--run", gpt_run, "--lengths", "16,32", "--batches", "1",
                  "--out", str(out))
    assert result.returncode == 0, result.stderr
    printed = json.loads(out.read_text())
    lines = result.stdout.splitlines()
    assert lines[0] == (f"{gpt_run}, step 6 (gpt): held-out part of the default corpus, "
                        "1 batch of 4, byte tokenizer")
    assert lines[1].startswith(f"loss {printed['loss']:.4f} nats per token, perplexity ")
    assert f"{printed['bits_per_byte']:.4f} bits per byte at the run's 32 tokens" in lines[1]
    table = lines[lines.index("") + 1:]
    assert table[0].split()[:4] == ["length", "loss", "perplexity", "bits"]
    for row, entry in zip(table[1:3], printed["by_length"], strict=True):
        curve = entry["loss_by_position"]
        assert row.split() == [str(entry["length"]), f"{entry['loss']:.4f}",
                               f"{entry['perplexity']:.4g}", f"{entry['bits_per_byte']:.4f}",
                               f"{curve[0]:.3f}", "->", f"{curve[-1]:.3f}"]
    assert lines[-1].startswith("(--json prints every figure")
    assert len(lines) <= 10
    assert printed["batches"] == 1 and math.isfinite(printed["bits_per_byte"])
    assert printed["plot"] == os.path.join(gpt_run, "eval_loss_by_position.png")
    assert os.path.exists(printed["plot"])
    help_ = tjax("eval", "--help")
    assert help_.returncode == 0 and "--lengths" in help_.stdout and "--passkey" in help_.stdout


@pytest.mark.slow
def test_errors_name_the_problem_and_the_fix(tmp_path):
    missing = tjax("eval", "--run", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no run directory" in missing.stderr
    assert "--run-dir of a tjax train run" in missing.stderr
    bert = tiny_run(tmp_path / "bert", TINY.replace(family="bert", mask="bidirectional",
                                                     position="learned", max_len=32))
    with pytest.raises(ValueError, match="32 positions, set by model.max_len.* lengths up to 32"):
        evaluate_run(bert, lengths=[64])
    with pytest.raises(ValueError, match="splits are read from tfds and hub.*drop --split"):
        evaluate_run(bert, split="validation")
    with pytest.raises(ValueError, match="--passkey needs a model that generates.*drop"):
        evaluate_run(bert, passkey=True)
    # a masked LM is still evaluated: loss and bits, no next-token curve (said so)
    result = evaluate_run(bert, plot=str(tmp_path / "b.png"))
    assert math.isfinite(result["loss"]) and result["plot"] is None
    assert "loss_by_position" not in result["by_length"][0]
    assert any("no loss by position" in n for n in result["notes"])


@pytest.mark.slow
def test_converted_hugging_face_runs(tmp_path):
    """A converted GPT-2 is evaluated on the default corpus: with the byte tokenizer (bits
    per byte), with its own BPE tokenizer (bits per token), and without a tokenizer (an
    error that says what to do)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_convert import make_gpt2, tiny_bpe_tokenizer

    from transformers_jax.convert import convert_hf_directory

    def gpt2(directory, vocab_size, n_positions=32):
        make_gpt2(directory, vocab_size=vocab_size, n_positions=n_positions)
        return str(directory)

    run = str(tmp_path / "byte_run")
    convert_hf_directory(gpt2(tmp_path / "byte", 262), run)
    result = evaluate_run(run, batches=1, plot=None)
    assert result["seq_len"] == 32 and math.isfinite(result["bits_per_byte"])
    with pytest.raises(ValueError, match="positions, set by model.max_len"):
        evaluate_run(run, lengths=[64])

    source = gpt2(tmp_path / "bpe", 320, n_positions=128)
    tiny_bpe_tokenizer(source)
    run = str(tmp_path / "bpe_run")
    convert_hf_directory(source, run)
    result = evaluate_run(run, batches=1, passkey=True, passkey_lengths=[128],
                          passkey_trials=1)
    assert result["tokenizer"] == "huggingface" and result["unit"] == "token"
    assert "bits_per_byte" not in result
    assert result["bits_per_token"] == pytest.approx(result["loss"] / math.log(2))
    assert 0.0 <= result["passkey"]["accuracy_by_length"]["128"] <= 1.0

    run = str(tmp_path / "external_run")
    source = gpt2(tmp_path / "external", 101)  # no tokenizer files, not the byte vocabulary
    convert_hf_directory(source, run)
    with pytest.raises(ValueError, match="no tokenizer this project can load.*token ids"):
        evaluate_run(run)
