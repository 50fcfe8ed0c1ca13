"""The side-by-side harness (benchmarks/side_by_side.py): its plain PyTorch GPT computes GPT-2's
function, the driver's summary and correctness arithmetic, and, end to end at a toy size, that
every contender in a process of its own starts from the same weights, sees the same batches
and optimizer (same losses) and decodes the same greedy tokens. Nothing here is timed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from benchmark_modules import ROOT, load_benchmark


@pytest.fixture(scope="module")
def driver():
    return load_benchmark("side_by_side")


def _tiny_gpt2(torch, transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=67, n_positions=24, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.slow
def test_plain_torch_gpt_is_gpt2_logits_and_greedy_tokens():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch_gpt = load_benchmark("torch_gpt")
    hf = _tiny_gpt2(torch, transformers)
    mine = torch_gpt.TorchGPT(torch_gpt.GPTShape(vocab=67, context=24, width=32, layers=2,
                                                 heads=4)).eval()
    mine.load_gpt2_state_dict(hf.state_dict())
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 67, (3, 11))).long()
    with torch.inference_mode():
        theirs = hf(input_ids=tokens).logits
        ours = mine(tokens)
    assert float((ours - theirs).abs().max()) < 1e-5
    prompt = tokens[:, :5]
    config = transformers.GenerationConfig(max_new_tokens=19, min_new_tokens=19, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        expected = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               generation_config=config)[:, 5:]
    assert torch.equal(mine.generate_greedy(prompt, 19), expected)
    # the fixed-shape step that torch.compile traces decodes the same tokens (here eager)
    assert torch.equal(mine.generate_greedy(prompt, 19, step=mine.decode_step), expected)
    with pytest.raises(ValueError, match="exceed the learned position table"):
        mine.generate_greedy(prompt, 20)  # 5 + 20 > 24


def test_plain_torch_gpt_names_a_missing_tensor():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch_gpt = load_benchmark("torch_gpt")
    state = _tiny_gpt2(torch, transformers).state_dict()
    del state["transformer.h.1.mlp.c_fc.bias"]
    mine = torch_gpt.TorchGPT(torch_gpt.GPTShape(vocab=67, context=24, width=32, layers=2,
                                                 heads=4))
    with pytest.raises(KeyError, match=r"h\.1\.mlp\.c_fc\.bias"):
        mine.load_gpt2_state_dict(state)


def _run(train, decode=None):
    out = {"training": {"tokens_per_s": train, "losses": [4.0, 3.0]}}
    if decode is not None:
        out["decoding"] = {"batch_1": {"tokens_per_s": decode, "tokens": [[1, 2, 3, 4]]}}
    return out


def test_summary_ratio_is_the_median_of_per_round_ratios(driver):
    runs = {"jax_float32": [_run(100.0, 10.0), _run(200.0, 30.0), _run(300.0, 20.0)],
            "hf": [_run(50.0, 5.0), _run(50.0, 10.0), _run(200.0, 4.0)]}
    summary = driver.summarise(runs)
    ours = summary["per_contender"]["jax_float32"]["training_tokens_per_s"]
    assert (ours["median"], ours["min"], ours["max"]) == (200.0, 100.0, 300.0)
    assert ours["spread"] == 1.0 and ours["per_round"] == [100.0, 200.0, 300.0]
    # per round 2, 4, 1.5: the median is 2, not 200 / 50 = 4 (the ratio of the medians)
    ratio = summary["ratios"]["jax_float32_vs_hf_training"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (2.0, 1.5, 4.0)
    decode = summary["ratios"]["jax_float32_vs_hf_decode_batch_1"]
    assert decode["per_round"] == [2.0, 3.0, 5.0] and decode["median"] == 3.0
    table = driver.markdown({"summary": summary, "load_average_start": [1.0],
                             "load_average_end": [2.0], "shape": {"name": "a"}, "rounds": 3,
                             "command": "x"})
    assert "| jax_float32_vs_hf_training | 2.00x | 1.50x | 4.00x |" in table
    assert "| hf | 50 [50-200] | 5 [4-10] |" in table
    # the caption names the CPU the figures belong to: ratios move with the machine
    machine = {"cpu_model": "Some CPU", "cpu_flags": {"avx512f": True, "avx512_bf16": False}}
    table = driver.markdown({"summary": summary, "load_average_start": [1.0],
                             "load_average_end": [2.0], "shape": {"name": "a"}, "rounds": 3,
                             "command": "x", "machine": machine, "cpu_count": 2})
    assert "machine: Some CPU, avx512f (no avx512_bf16), 2 CPUs;" in table


def test_every_timed_step_is_kept_per_process(driver):
    runs = {"jax_float32": [{"training": {"step_s": [0.1, 0.2]}},
                            {"training": {"step_s": [0.3]}}],
            "hf": [{"training": {"losses": [1.0]}}],  # an untimed worker: nothing to keep
            "torch": [{"decoding": {}}]}
    assert driver.step_times_ms(runs) == {"jax_float32": [[100.0, 200.0], [300.0]]}


def test_a_worker_without_json_output_is_named(driver, tmp_path, monkeypatch):
    (tmp_path / "silent.py").write_text("print('not json')\n")
    monkeypatch.setattr(driver, "HERE", str(tmp_path))
    with pytest.raises(RuntimeError, match="silent.py printed no JSON object.*not json"):
        driver.run_worker("silent.py", [], lambda message: None, timeout=60)


def test_correctness_flags_a_loss_gap_and_a_different_token(driver):
    ours = _run(1.0, 1.0)
    close = _run(1.0, 1.0)
    close["training"]["losses"] = [4.0 * (1 + 1e-5), 3.0]
    far = _run(1.0, 1.0)
    far["training"]["losses"] = [4.0, 3.0 * 1.01]
    far["decoding"]["batch_1"]["tokens"] = [[1, 2, 9, 4]]
    bf16 = _run(1.0, 1.0)
    bf16["training"]["losses"] = [4.1, 3.1]  # not expected to be exact: reported, not failed
    ok = driver.correctness({"jax_float32": ours, "hf": close, "jax_bfloat16": bf16}, 10, 1e-3)
    assert ok["passed"] and ok["hf"]["losses_match"]
    assert ok["hf"]["loss_relative_gap_first_steps"] == pytest.approx(1e-5)
    assert ok["hf"]["greedy_tokens_identical_batch_1"] == 1.0
    assert not ok["jax_bfloat16"]["losses_match"] and not ok["jax_bfloat16"]["exact_expected"]
    bad = driver.correctness({"jax_float32": ours, "torch": far}, 10, 1e-3)
    assert not bad["passed"] and not bad["torch"]["losses_match"]
    assert bad["torch"]["greedy_tokens_identical_batch_1"] == 0.75
    # only the first check_steps count for the verdict
    assert driver.correctness({"jax_float32": ours, "torch": far}, 1, 1e-3)["torch"][
        "losses_match"]


def test_workers_get_no_thread_settings(driver, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = driver.worker_environment()
    assert "OMP_WAIT_POLICY" not in env and "OMP_NUM_THREADS" not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/elsewhere"]


def test_driver_refuses_a_gpt_contender_for_bert(driver, capsys):
    with pytest.raises(SystemExit):
        driver.main(["--check", "--shape", "tiny_bert", "--contenders", "jax_float32,torch"])
    assert "cannot run shape tiny_bert (a bert)" in capsys.readouterr().err


def test_contender_at_n_is_pinned_to_n_cores(driver, capsys):
    assert driver.parse_contender("hf") == ("hf", None)
    assert driver.parse_contender("jax_float32@1") == ("jax_float32", 1)
    for bad in ("hf@0", "hf@x", f"hf@{(os.cpu_count() or 1) + 1}"):
        with pytest.raises(ValueError, match="core count"):
            driver.parse_contender(bad)
    with pytest.raises(SystemExit):
        driver.main(["--check", "--tiny", "--contenders", "hf@0"])
    assert "core count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        driver.main(["--check", "--tiny", "--contenders", "pytorch@1"])
    assert "unknown contenders ['pytorch@1']" in capsys.readouterr().err


@pytest.mark.slow
def test_check_mode_separate_processes_agree(driver, tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "check.json"
    # each process proves something no other does (each costs seconds of imports): HF's GPT-2
    # on every core; the plain PyTorch GPT pinned to one core (its in-process equality with
    # HF's GPT-2 is test_plain_torch_gpt_is_gpt2_logits_and_greedy_tokens); ours with the
    # batch as two row groups and the other malloc at once (either one wrong moves the numbers)
    code = driver.main(["--check", "--tiny", "--contenders",
                        "jax_float32,hf,torch@1,jax_float32_g2_reuse",
                        "--check-steps", "4", "--quiet", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, result["correctness"]
    assert result["mode"] == "check" and "summary" not in result  # nothing timed
    correctness = result["correctness"]
    assert correctness["passed"]
    # pinned to one core, the batch as two row groups, another malloc: the same numbers
    for name in ("hf", "torch@1", "jax_float32_g2_reuse"):
        entry = correctness[name]
        assert entry["loss_relative_gap_all_steps"] < 1e-5, (name, entry)
        assert entry["greedy_tokens_identical_batch_1"] == 1.0
        assert entry["greedy_tokens_identical_batch_2"] == 1.0
    losses = result["losses_first_round"]
    assert len(losses["jax_float32"]) == 4 and losses["jax_float32"][-1] < losses["jax_float32"][0]
    assert result["isolation"]["jax_float32"]["torch_imported"] is False
    assert result["isolation"]["hf"]["jax_imported"] is False
    assert result["isolation"]["torch@1"]["jax_imported"] is False
    assert all(env == {} for env in result["worker_thread_environment"].values())
    # @1: the worker may use one CPU, and PyTorch sized its pool to it (nothing set by us)
    assert result["pinned_cores"] == {"jax_float32": None, "hf": None, "torch@1": 1,
                                      "jax_float32_g2_reuse": None}
    assert result["threads"]["torch@1"]["torch_num_threads"] == 1
    assert result["threads"]["torch@1"]["set_by_harness"] is None
    if result["host_malloc"]["hf"] != "not glibc":  # ours as tjax runs, theirs as the system's
        assert result["host_malloc"] == {"jax_float32": "huge pages", "hf": "system default",
                                         "torch@1": "system default",
                                         "jax_float32_g2_reuse":
                                             "freed blocks reused (TJAX_HOST_MALLOC=reuse)"}


@pytest.mark.slow
def test_check_mode_bert_separate_processes_agree(driver, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "check.json"
    code = driver.main(["--check", "--shape", "tiny_bert", "--check-steps", "4", "--quiet",
                        "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, result["correctness"]
    assert result["contenders"] == ["jax_float32", "hf"]  # the default: those a BERT can run
    entry = result["correctness"]["hf"]
    losses = result["losses_first_round"]
    # the same function at step 0; after a few AdamW steps BERT's float32 rounding differences
    # grow faster than GPT-2's (the earlier 43-step run: 3.4e-4), still far below tolerance
    assert abs(losses["hf"][0] - losses["jax_float32"][0]) < 1e-6 * losses["hf"][0]
    assert entry["loss_relative_gap_all_steps"] < 1e-4, entry
    assert not any(k.startswith("greedy") for k in entry)  # a masked LM does not decode
    assert result["isolation"]["hf"]["jax_imported"] is False
