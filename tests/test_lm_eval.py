"""The lm-eval adapter (``transformers_jax/harness``) on a tiny trained run: its
log-likelihoods are minus the run's own eval-step loss on the same tokens, rolling scores sum
disjoint windows as ``evaluation.stream_losses`` scores them, batching and padding change no
number, ``generate_until`` is our greedy ``generate`` cut at ``until``, and ``tjax eval
--lm-eval`` scores a multiple-choice task written here (no hub access) as the adapter's own
log-likelihoods rank its choices."""

import json
import os
import types

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from transformers_jax import ModelConfig, TrainConfig  # noqa: E402
from transformers_jax.evaluation import stream_losses  # noqa: E402
from transformers_jax.harness.model import TjaxLM, generation_refusal  # noqa: E402
from transformers_jax.learning.step import make_eval_step  # noqa: E402
from transformers_jax.runs.load import open_run  # noqa: E402
from transformers_jax.sample import SamplingConfig, generate  # noqa: E402
from transformers_jax.train.loop import train  # noqa: E402

SEQ_LEN = 32  # the run's seq_len: the adapter's max_length (rope has no table)
TEXTS = ["The for statement", "x", "def f(x):\n    return x + 1\n", "while True: pass"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm_eval") / "gpt"
    train(ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=256),
          TrainConfig(steps=6, batch_size=4, seq_len=SEQ_LEN, warmup_steps=1, log_every=3,
                      eval_every=6, eval_batches=1, progress=False, run_dir=str(run_dir),
                      tensorboard=False))
    return open_run(str(run_dir))


@pytest.fixture(scope="module")
def lm(run):
    return TjaxLM(run, batch_size=4)


def request(*args):
    return types.SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def own_loss(run):
    """``(tokens, n) -> (summed loss of the last n tokens, all of them predicted)``: the run's
    eval step (the training loop's loss) on exactly these tokens, no padding."""
    step = jax.jit(make_eval_step(run.model, run.objective))

    def loss(tokens, n):
        tokens = np.asarray(tokens, np.int32)[None]
        weights = np.zeros((1, tokens.shape[1] - 1), np.float32)
        weights[0, -n:] = 1
        metrics = jax.device_get(step(run.params, {"inputs": tokens[:, :-1],
                                                    "targets": tokens[:, 1:],
                                                    "weights": weights}))
        return float(metrics["loss"]) * n, float(metrics["accuracy"]) == 1.0

    return loss


def ids(run, text):
    return [int(t) for t in run.tokenizer.encode(text)]


@pytest.mark.slow
def test_loglikelihood_is_minus_the_runs_own_loss(run, lm, own_loss):
    bos = run.tokenizer.bos_id
    pairs = [("", t) for t in TEXTS] + [("The for", " statement"), ("a", "b"),
                                         ("def f(x):", "\n    return x")]
    results = lm.loglikelihood([request(c, x) for c, x in pairs])
    for (context, continuation), (logp, greedy) in zip(pairs, results, strict=True):
        tokens = [bos, *ids(run, context + continuation)]
        n = len(ids(run, continuation))
        loss, all_predicted = own_loss(tokens, n)
        assert logp == pytest.approx(-loss, rel=1e-5, abs=1e-4), (context, continuation)
        assert greedy == all_predicted
    assert all(logp < 0 for logp, _ in results)


@pytest.mark.slow
def test_greedy_continuations_are_flagged_greedy(run, lm):
    prompt = [run.tokenizer.bos_id, *ids(run, "The for statement")]
    new = generate(run.model, run.params, [prompt],
                   SamplingConfig(max_new_tokens=6, temperature=0.0))[0]
    wrong = [*new[:-1], (new[-1] + 1) % 256]
    (_, greedy), (_, not_greedy) = lm._loglikelihood_tokens(
        [(("", ""), prompt, new), (("", ""), prompt, wrong)])
    assert greedy and not not_greedy


@pytest.mark.slow
def test_a_long_context_loses_tokens_from_the_left(run, lm, own_loss):
    context, continuation = "abcdefgh" * 8, " the end"  # 64 + 8 bytes past max_length 32
    (logp, _), = lm.loglikelihood([request(context, continuation)])
    tokens = [run.tokenizer.bos_id, *ids(run, context + continuation)][-(SEQ_LEN + 1):]
    assert logp == pytest.approx(-own_loss(tokens, len(continuation))[0], rel=1e-5, abs=1e-4)


@pytest.mark.slow
def test_rolling_sums_disjoint_windows(run, lm, own_loss):
    # 3 * 32 predicted bytes: whole windows, as stream_losses scores a stream side by side
    text = ("The quick brown fox jumps over the lazy dog. " * 3)[: 3 * SEQ_LEN]
    stream = np.array([run.tokenizer.bos_id, *ids(run, text)], np.int32)
    (rolling,) = lm.loglikelihood_rolling([request(text)])
    windows = stream_losses(run.model, run.params, stream, SEQ_LEN)
    assert not np.isnan(windows[1:]).any()  # every byte scored once
    assert rolling == pytest.approx(-windows[1:].sum(), rel=1e-5)
    # 70 bytes: two whole windows, then the last 6 scored after a full window of context
    tail = text[:70]
    stream = [run.tokenizer.bos_id, *ids(run, tail)]
    expected = (own_loss(stream[: SEQ_LEN + 1], SEQ_LEN)[0]
                + own_loss(stream[SEQ_LEN : 2 * SEQ_LEN + 1], SEQ_LEN)[0]
                + own_loss(stream[-(SEQ_LEN + 1):], 6)[0])
    short = TEXTS[2]  # one window: the loglikelihood of the text after bos
    rolled = lm.loglikelihood_rolling([request(tail), request(short)])
    assert rolled[0] == pytest.approx(-expected, rel=1e-5)
    assert rolled[1] == pytest.approx(lm.loglikelihood([request("", short)])[0][0], rel=1e-6)


@pytest.mark.slow
def test_batching_and_padding_change_no_number(run):
    requests = [request(c, x) for c, x in [("", t) for t in TEXTS] + [
        ("The for", " statement"), ("abc" * 20, "d"), ("q", "uick brown fox jumps")]]
    one = TjaxLM(run, batch_size=1).loglikelihood(requests)
    many = TjaxLM(run, batch_size=5).loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(one, many, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and greedy_a == greedy_b
    texts = [request(t * 5) for t in TEXTS]
    np.testing.assert_allclose(TjaxLM(run, batch_size=1).loglikelihood_rolling(texts),
                               TjaxLM(run, batch_size=3).loglikelihood_rolling(texts), rtol=1e-5)


@pytest.mark.slow
def test_generate_until_is_greedy_sampling_cut_at_until(run, lm):
    tok = run.tokenizer
    prompts = [[tok.bos_id, *ids(run, t)] for t in TEXTS]
    greedy = generate(run.model, run.params, prompts,
                      SamplingConfig(max_new_tokens=12, temperature=0.0,
                                     stop_tokens=(tok.eos_id,), pad_id=tok.pad_id))
    texts = [tok.decode([t for t in row if t != tok.eos_id]) for row in greedy]
    got = lm.generate_until([request(t, {"until": [], "max_gen_toks": 12}) for t in TEXTS])
    assert got == texts
    # a stop string inside each continuation: the text before its first occurrence; one of
    # one byte also ends the row in the compiled loop
    for stop in (texts[0][3:5], texts[0][4]):
        got = lm.generate_until([request(t, {"until": [stop], "max_gen_toks": 12})
                                 for t in TEXTS])
        assert got == [t.split(stop)[0] for t in texts]
        assert len(got[0]) < len(texts[0])


MC_ROWS = [{"question": "The for", "choices": [" statement", " xyzzy", " 7"], "answer": 0},
           {"question": "def f(x):", "choices": ["\n    return", " ???", "!!"], "answer": 0},
           {"question": "while", "choices": [" True", " Qq", " 0 0"], "answer": 2},
           {"question": "import", "choices": [" os", " os.path"], "answer": 1}]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """A folder holding one multiple-choice task of our own (no hub access)."""
    tasks = tmp_path_factory.mktemp("tasks")
    (tasks / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    (tasks / "tiny_mc.yaml").write_text(f"""task: tjax_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "rows.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    higher_is_better: true
""")
    return str(tasks)


@pytest.mark.slow
def test_tjax_eval_lm_eval_scores_a_local_multiple_choice_task(run, lm, tasks_dir, tmp_path,
                                                               monkeypatch, capfd):
    """``tjax eval --lm-eval`` (its ``main``, in this process: lm-eval and the run's programs
    are loaded once) scores the task as the adapter's own log-likelihoods rank its choices."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    out = tmp_path / "result.json"
    rc, stdout, err = tjax_in_process(
        ["eval", "--run", run.directory, "--lm-eval", "tjax_tiny_mc", "--include-path",
         tasks_dir, "--batch-size", "3", "--out", str(out)])
    assert rc == 0, err[-3000:]
    result = json.loads(out.read_text())  # the table on stdout, every figure in --out
    scores = result["results"]["tjax_tiny_mc"]
    rows = [line.split() for line in stdout.splitlines()]
    assert ["tjax_tiny_mc", "acc", f"{scores['acc,none']:.4f}", f"{scores['acc_stderr,none']:.4f}",
            "0", "4"] in rows
    # the expected accuracy: the adapter's own log-likelihoods, ranked here
    right = [int(np.argmax([lm.loglikelihood([request(r["question"], c)])[0][0]
                            for c in r["choices"]])) == r["answer"] for r in MC_ROWS]
    assert scores["acc,none"] == pytest.approx(np.mean(right))
    assert result["n_samples"]["tjax_tiny_mc"]["effective"] == 4
    assert result["step"] == run.step and result["batch_size"] == 3
    assert result["max_length"] == SEQ_LEN
    # lm-eval's own git lookup (``git describe`` in the working folder) is skipped: outside a
    # checkout it printed "fatal: not a git repository"
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert tjax_in_process(["eval", "--run", run.directory, "--lm-eval", "tjax_tiny_mc",
                            "--include-path", tasks_dir, "--limit", "1"])[0] == 0
    assert "fatal" not in capfd.readouterr().err


def tjax_in_process(argv):
    """``tjax ARGV`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from transformers_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
    return rc, out.getvalue(), err.getvalue()


def test_a_bad_run_directory_fails_naming_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    for argv, expected in [
        (["--run", str(tmp_path / "empty"), "--lm-eval", "x"], "no checkpoints"),
        (["--run", str(tmp_path / "missing"), "--lm-eval", "x"], "no run directory"),
    ]:
        rc, _, err = tjax_in_process(["eval", *argv])
        assert rc == 2 and expected in err and "Traceback" not in err, (argv, err)


@pytest.mark.slow
def test_bad_requests_fail_naming_the_fix(run, tmp_path, monkeypatch):
    import dataclasses
    import importlib.util

    for argv, expected in [
        (["--run", run.directory, "--lm-eval", "x", "--include-path", str(tmp_path / "no")],
         "--include-path"),
        (["--run", run.directory, "--lm-eval", "x", "--lengths", "16"], "--lengths"),
        (["--run", run.directory, "--limit", "3"], "--limit apply to lm-eval tasks"),
        (["--run", run.directory, "--lm-eval", "x", "--batch-size", "0"], "--batch-size 0"),
        (["--run", run.directory, "--lm-eval", "x", "--limit", "2.5"], "--limit 2.5"),
    ]:
        rc, _, err = tjax_in_process(["eval", *argv])
        assert rc == 2 and expected in err and "Traceback" not in err, (argv, err)
    with pytest.raises(ValueError, match="no tokenizer this project can load"):
        TjaxLM(dataclasses.replace(run, tokenizer=None))
    masked = types.SimpleNamespace(name="mlm", per_position=False, head=None)
    with pytest.raises(ValueError, match="lm-eval scores models that predict the next token"):
        TjaxLM(dataclasses.replace(run, objective=masked))
    with pytest.raises(ValueError, match="max_gen_toks=40 leaves no room"):
        TjaxLM(run).generate_until([request("a", {"until": [], "max_gen_toks": 40})])
    with pytest.raises(ValueError, match="batch_size='many'"):
        TjaxLM(run, batch_size="many")
    # lm-eval not installed: the extra to install
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    rc, _, err = tjax_in_process(["eval", "--run", run.directory, "--lm-eval", "hellaswag"])
    assert rc == 2 and "pip install 'transformers-jax[lm-eval]'" in err, err


@pytest.mark.slow
def test_an_unknown_task_names_the_nearest_known_one(run, tasks_dir):
    """Checked against lm-eval's real catalogue (the index the multiple-choice test uses)."""
    from transformers_jax.harness.tasks import evaluate_tasks

    with pytest.raises(ValueError, match=r"unknown task 'hellaswg'; did you mean hellaswag"):
        evaluate_tasks(run.directory, ["hellaswg"], include_path=tasks_dir)


def test_a_hub_task_offline_is_one_line_at_once(run, tasks_dir, monkeypatch):
    """``--lm-eval hellaswag`` with no network (as here): the process goes offline after one
    probe, and the uncached dataset is one error naming the fix, not a minute of retries and a
    traceback."""
    from transformers_jax.data import hub_offline
    from transformers_jax.harness.tasks import evaluate_tasks

    monkeypatch.setattr(hub_offline, "hub_reachable", lambda timeout=3.0: False)
    for name in hub_offline.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"--lm-eval hellaswag: a task's dataset is on the "
                                         r"Hugging Face hub, which cannot be reached"):
        evaluate_tasks(run.directory, ["hellaswag"], include_path=tasks_dir, limit=2)


def test_the_task_index_is_built_once_per_folder_contents(tmp_path, monkeypatch):
    """Indexing lm-eval's catalogue takes seconds: one ``TaskManager`` per process for the
    same folder, a new one when a task file is added or edited (never a stale index)."""
    import lm_eval.tasks

    from transformers_jax.harness import tasks

    built = []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        lambda include_path=None: built.append(include_path) or len(built))
    tasks.task_manager.cache_clear()
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "a.yaml").write_text("task: a\n")
    assert tasks.task_manager(str(folder)) == tasks.task_manager(str(folder)) == 1
    assert tasks.task_manager(None) == 2 and tasks.task_manager(None) == 2
    (folder / "b.yaml").write_text("task: b\n")
    assert tasks.task_manager(str(folder)) == 3
    os.utime(folder / "a.yaml", ns=(0, 0))
    assert tasks.task_manager(str(folder)) == 4 and built == [str(folder), None, *[str(folder)] * 2]
    tasks.task_manager.cache_clear()


@pytest.mark.parametrize("changes, reason", [
    ({}, None),
    ({"family": "encdec"}, "family='encdec' does not continue a prompt"),
    ({"family": "bert", "mask": "bidirectional"}, "family='bert' does not continue"),
    ({"mask": "bidirectional"}, "mask='bidirectional' does not decode left to right"),
    ({"position": {"name": "randomized"}}, "--model.position.evaluate=real"),
    ({"attention": "pallas"}, "attention=chunked or xla"),
])
def test_generation_is_refused_with_the_decoding_checks_reason(changes, reason):
    """lm-eval's generation tasks are refused for what cannot generate, with the reason the
    sampler itself would give (family, mask, positions, kernel), and allowed otherwise."""
    config = ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                   max_len=32), **changes})
    got = generation_refusal(config)
    assert got is None if reason is None else reason in got, got
