"""Hugging Face tokenizers for training (issue 50, item 2): ``tjax tokenizer train`` writes a
tokenizer.json, ``--train.tokenizer=hf:PATH`` trains with it, the run keeps it and decodes with
it; a file without an end-of-text token, or an MLM run without [MASK], is refused clearly."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random

import pytest

pytest.importorskip("tokenizers")

from transformers_jax.cli import main  # noqa: E402
from transformers_jax.config import ConfigError, ModelConfig, TrainConfig  # noqa: E402
from transformers_jax.data.hf_tokenizer import HFJsonTokenizer  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while über café naïve "
         "alpha beta gamma delta return value def class").split()
ROUND_TRIP = "The quick fox, über café!\n\tdef f(x): return 42  </s> [MASK] 日本"


def tjax(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse
            code = stop.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """A few KB of text in four files (documents)."""
    root = tmp_path_factory.mktemp("hf_tok_text")
    r = random.Random(0)
    for i in range(4):
        lines = [" ".join(r.choice(WORDS) for _ in range(10)) for _ in range(40)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(root)


@pytest.fixture(scope="module")
def bpe_file(text_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_tok") / "tok.json")
    code, stdout, err = tjax(["tokenizer", "train", "--data", text_dir, "--vocab", "300",
                              "--out", out])
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["vocab_size"] == 300 and summary["special"]["mask"] == 3
    return out


def test_trained_bpe_round_trips_and_maps_special_tokens(bpe_file):
    import tokenizers

    tok = HFJsonTokenizer.from_path(bpe_file)
    own = tokenizers.Tokenizer.from_file(bpe_file)
    assert tok.vocab_size == own.get_vocab_size() == 300
    assert tok.special == {"pad": 0, "bos": 1, "eos": 2, "mask": 3, "cls": 1, "sep": 2}
    plain = "the quick brown fox, über alles\n  return 7"
    assert tok.encode(plain).tolist() == own.encode(plain, add_special_tokens=False).ids
    assert tok.decode(tok.encode(plain)) == own.decode(tok.encode(plain).tolist()) == plain
    ids = tok.encode(ROUND_TRIP)  # byte-level: lossless; a literal "</s>" stays text
    assert tok.decode(ids) == ROUND_TRIP and not set(ids.tolist()) & {0, 1, 2, 3}
    assert tok.decode([1, *ids.tolist(), 2, 0]) == ROUND_TRIP  # specials are dropped
    assert len(ids) < len(ROUND_TRIP.encode())  # merges were learned


def test_unigram_trains_too(text_dir, tmp_path):
    code, stdout, err = tjax(["tokenizer", "train", "--data", f"lines:{text_dir}/doc0.txt",
                              "--vocab", "300", "--model", "unigram", "--out", str(tmp_path)])
    assert code == 0, err
    tok = HFJsonTokenizer.from_path(str(tmp_path))  # a folder holding tokenizer.json
    assert json.loads(stdout)["model"] == "unigram"
    assert tok.special["eos"] == 2 and tok.special["mask"] == 3
    assert tok.decode(tok.encode(ROUND_TRIP)) == ROUND_TRIP


@pytest.mark.slow
def test_train_with_hf_tokenizer_keeps_it_in_the_run_and_samples(bpe_file, text_dir, tmp_path):
    from transformers_jax.runs import load_run
    from transformers_jax.sample import SamplingConfig, generate

    run_dir = str(tmp_path / "run")
    code, _, err = tjax(["train", "--data", text_dir, f"--train.tokenizer=hf:{bpe_file}",
                         "--steps", "3", "--run-dir", run_dir, "--no-progress",
                         "--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2",
                         "--train.batch_size=2", "--train.seq_len=16", "--train.eval_every=3",
                         "--train.eval_batches=1", "--train.checkpoint_every=3"])
    assert code == 0, err
    kept = os.path.join(run_dir, "tokenizer", "hf", "tokenizer.json")
    with open(kept, "rb") as a, open(bpe_file, "rb") as b:
        assert a.read() == b.read()
    model, params, tokenizer, config = load_run(run_dir)
    assert tokenizer.name == "hf" and config.vocab_size == 300  # the vocab followed the file
    own = HFJsonTokenizer.from_path(bpe_file)
    assert tokenizer.special == own.special
    assert tokenizer.encode(ROUND_TRIP).tolist() == own.encode(ROUND_TRIP).tolist()
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP)) == ROUND_TRIP
    prompt = tokenizer.encode("the quick")
    out = generate(model, params, [list(prompt)],
                   SamplingConfig(max_new_tokens=4, temperature=0.0,
                                  stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
                                  bos_id=tokenizer.bos_id))[0]
    assert isinstance(tokenizer.decode(out), str)
    code, stdout, err = tjax(["sample", "--run", run_dir, "--prompt", "the quick",
                              "--max-new-tokens", "3", "--temperature", "0"])
    assert code == 0 and stdout.startswith("the quick"), err


def _without(source: str, drop: set[str], target) -> str:
    """``source`` (a tokenizer.json) with the added tokens ``drop`` renamed away."""
    with open(source, encoding="utf-8") as f:
        meta = json.load(f)
    renames = {name: f"<x{i}>" for i, name in enumerate(sorted(drop))}
    for token in meta["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    vocab = meta["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    target.write_text(json.dumps(meta), encoding="utf-8")
    return str(target)


def test_a_tokenizer_without_an_end_of_text_is_refused_naming_its_tokens(bpe_file, tmp_path):
    path = _without(bpe_file, {"</s>"}, tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"no end-of-text token.*</s>, <\|endoftext\|>.*"
                                         r"special tokens are: <pad>, <s>, <x0>, \[MASK\]"):
        HFJsonTokenizer.from_path(path)
    code, _, err = tjax(["train", f"--train.tokenizer=hf:{tmp_path}", "--steps", "1"])
    assert code == 2 and "no end-of-text token" in err and "Traceback" not in err


def test_a_model_folder_config_names_its_eos(bpe_file, tmp_path):
    _without(bpe_file, {"</s>"}, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<x0>"}))
    assert HFJsonTokenizer.from_path(str(tmp_path)).eos_id == 2


def test_an_mlm_run_without_mask_is_refused(bpe_file, text_dir, tmp_path):
    from transformers_jax.train.loop import train

    path = _without(bpe_file, {"[MASK]"}, tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"masked LM.*needs a mask token.*\[MASK\].*its "
                                         r"special tokens are: <pad>, <s>, </s>, <x0>"):
        train(ModelConfig(family="bert", d_model=16, n_layers=1, n_heads=2),
              TrainConfig(steps=1, batch_size=2, seq_len=16, data=text_dir,
                          tokenizer=f"hf:{path}", progress=False), auto_vocab=True)


@pytest.mark.parametrize("value, message", [
    ("hf", "needs a path: hf:PATH"),
    ("hf:", "needs a path"),
    ("byte:x.json", "takes no path"),
    ("huggingface", "not trained"),
    ("nope:x", "not known"),
])
def test_tokenizer_values_are_checked_up_front(value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(tokenizer=value)
    with pytest.raises(ConfigError, match="its own vocabulary"):
        TrainConfig(tokenizer="hf:tok.json", tokenizer_vocab=512)


def test_missing_or_foreign_files_are_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        HFJsonTokenizer.from_path(str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json.*tokenizer.model"):
        HFJsonTokenizer.from_path(str(tmp_path))
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"kind": "byte", "vocab_size": 262}))
    with pytest.raises(ValueError, match="transformers-jax run's tokenizer"):
        HFJsonTokenizer.from_path(str(ours))
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"model": 3}))
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        HFJsonTokenizer.from_path(str(junk))


@pytest.mark.parametrize("argv, message", [
    (["tokenizer", "--help"], None),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--vocab", "100"], "too small"),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--model", "wordpiece"], "invalid choice"),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--data", "{tmp}/missing"], "missing"),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--max-bytes", "0"], "--max-bytes"),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--vocab", "x"], "invalid int"),
    (["tokenizer", "train", "--out", "{tmp}/t.json", "--val-fraction", "1.5"], "val_fraction"),
    (["tokenizer", "train"], "--out"),
    (["tokenizer", "fit", "--out", "x"], "invalid choice"),
    (["tokenizer", "train", "--out", "x", "--vcoab", "3"], "did you mean --vocab"),
])
def test_tokenizer_command_help_and_bad_arguments(argv, message, tmp_path):
    code, out, err = tjax([a.format(tmp=tmp_path) for a in argv])
    if message is None:
        assert code == 0 and "tjax tokenizer" in out and "--vocab" in out
        return
    assert code == 2 and message in err and "Traceback" not in err, err



GARBAGE = ["", "abc", "1.5", "nan", "-1", "0", "1e3", " 7", "\x00", "é"]


def test_tokenizer_command_fuzzed_options_train_or_exit_2(text_dir, tmp_path):
    """As tests/test_fuzz.py does for sample and eval: every drawn command line trains a
    tokenizer (a JSON summary) or exits 2 with a one-line error, never a traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from profiles import examples

    def mostly(valid, invalid):
        return st.one_of(valid, valid, valid, st.sampled_from(invalid))

    table = {"--vocab": mostly(st.sampled_from(["262", "300", "400"]), GARBAGE),
             "--model": mostly(st.sampled_from(["bpe", "unigram"]), ["BPE", "wordpiece", ""]),
             "--data": mostly(st.sampled_from(["{text}", "lines:{text}/doc1.txt"]),
                              ["{tmp}/missing", "lines:", "tfds:", "bogus:x", "{tmp}"]),
             "--val-fraction": mostly(st.sampled_from(["0.05", "0.5"]), GARBAGE),
             "--max-bytes": mostly(st.sampled_from(["2000", "100000"]), GARBAGE),
             "--out": mostly(st.sampled_from(["{tmp}/a.json", "{tmp}/sub/"]),
                             ["", "{text}/doc0.txt/x.json"])}
    options = st.dictionaries(st.sampled_from(sorted(table)), st.just(None), max_size=4).flatmap(
        lambda keys: st.fixed_dictionaries({k: table[k] for k in keys}))

    @settings(max_examples=examples(ci=8, thorough=25), derandomize=True, database=None,
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(options)
    def check(drawn):
        drawn = {"--out": "{tmp}/a.json", "--data": "{text}", **drawn}
        argv = ["tokenizer", "train"]
        for key, value in drawn.items():
            argv.append(f"{key}={value.format(text=text_dir, tmp=tmp_path)}")
        code, out, err = tjax(argv)
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert "error:" in err and "Traceback" not in err, (argv, err)
        else:
            assert json.loads(out)["vocab_size"] > 256, argv

    check()
