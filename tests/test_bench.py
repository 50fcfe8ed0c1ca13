"""The benchmark commands run end to end at a toy size and print the JSON they promise.

Speed is never asserted (it depends on the machine and its load): only that every figure the
benchmark issue asks for is present, of the right kind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from benchmark_modules import load_benchmark
from subprocess_env import user_compile_env

from transformers_jax import bench
from transformers_jax.config import ConfigError


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


@pytest.mark.slow
def test_tjax_bench_tiny_prints_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--steps", "2", "--warmup", "1", "--decode-tokens", "4",
                       "--decode-batches", "1,2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    result = json.loads(out.read_text())
    assert printed == result
    training = result["training"]
    for key in ("tokens_per_s", "step_ms_median", "flops_per_token", "achieved_flops_per_s",
                "compile_s", "compile_cpu_s", "first_step_s", "compiled_temp_bytes", "params"):
        assert _positive(training[key]), key
    assert set(training["mfu"]) == set(training["peak_flops"]) == {"float32"}
    assert _positive(training["mfu"]["float32"])
    # causal attention at half (MaxText's count): fewer FLOPs, a lower MFU
    assert 0 < training["flops_per_token_causal_half"] < training["flops_per_token"]
    assert 0 < training["mfu_causal_half"]["float32"] < training["mfu"]["float32"]
    decoding = result["decoding"]
    for batch in ("batch_1", "batch_2"):
        for key in ("decode_tokens_per_s", "ms_per_step", "time_to_first_token_ms"):
            assert _positive(decoding[batch][key]), (batch, key)
    assert decoding["new_tokens"] == 4
    assert _positive(result["peak_rss_bytes"])
    for key in ("device", "platform", "cpu", "load_average", "date"):
        assert result[key], key
    assert {"jax", "flax", "optax", "numpy", "python"} <= set(result["versions"])


@pytest.mark.slow
def test_tjax_bench_bf16_reports_both_peaks_and_bert_skips_decoding(capsys):
    assert bench.main(["--tiny", "--steps", "1", "--warmup", "0", "--model.dtype=bfloat16",
                       "--family", "bert"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["training"]["mfu"]) == {"bfloat16", "float32"}
    assert result["model"]["mask"] == {"name": "bidirectional"}
    assert result["decoding"] is None and "bert" in result["decoding_note"]
    peaks = result["training"]["peak_flops"]  # the warning follows what was measured
    assert ("dtype_note" in result["training"]) == (peaks["bfloat16"] < peaks["float32"])


@pytest.mark.slow
def test_packed_rows_hold_documents_that_restart_their_positions(capsys):
    rng = np.random.default_rng(0)
    packed = bench.packed_documents(4, 64, rng)
    seg, pos = packed["segment_ids"], packed["positions"]
    for row_seg, row_pos in zip(seg, pos, strict=True):
        assert row_seg[0] == 1 and np.all(np.diff(row_seg) >= 0)  # documents end to end
        assert np.all((np.diff(row_seg) == 0) | (np.diff(row_seg) == 1)) and row_seg.min() == 1
        starts = np.flatnonzero(np.diff(row_seg)) + 1
        assert np.all(row_pos[starts] == 0) and row_pos[0] == 0  # each document from 0
        lengths = np.diff(np.r_[0, starts, 64])
        assert np.all(lengths[:-1] >= 64 // 8) and np.all(lengths <= 3 * 64 // 4)
    assert seg.max() >= 2  # more than one document in a row
    assert bench.main(["--tiny", "--steps", "1", "--warmup", "0", "--no-decode",
                       "--packed"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["packed"] is True and _positive(result["training"]["tokens_per_s"])


def test_slower_dtype_note_says_when_float32_is_faster():
    assert bench.slower_dtype_note("float32", {"float32": 1e11}) is None
    assert bench.slower_dtype_note("bfloat16", {"bfloat16": 8.9e11, "float32": 4.4e11}) is None
    note = bench.slower_dtype_note("bfloat16", {"bfloat16": 9.3e10, "float32": 1.38e11})
    assert "93 against 138 GFLOP/s" in note and "AVX512_BF16" in note and "float32" in note


def test_bench_options_are_separated_from_overrides(capsys):
    args, overrides, _ = bench.bench_parser().parse(
        ["--tiny", "--warmup", "2", "--model.d_model=64", "--out=x.json", "--steps", "3",
         "--decode-batches=2,4"])
    assert (args.tiny, args.warmup, args.out, args.decode_batches) == (True, 2, "x.json", [2, 4])
    assert not args.no_decode and args.compile_cache is None
    assert overrides == {"model.d_model": "64", "train.steps": "3"}
    for argv, message in ((["--warmpu", "2"], "did you mean --warmup?"),
                          (["--decode-batches=0,x"], "expected numbers like 128,256"),
                          (["--modle.d_model=3"], "did you mean --model.d_model?")):
        with pytest.raises((SystemExit, ConfigError)) as stop:
            bench.bench_parser().parse(argv)
        err = str(stop.value) if stop.type is ConfigError else capsys.readouterr().err
        assert (stop.type is ConfigError or stop.value.code == 2) and message in err, argv


def test_bench_refuses_gradient_accumulation():
    """tjax bench (and profile_step.py, through ``training_setup``) times one step over the
    whole batch: a grad_accum it would ignore is refused by name, before any compile."""
    model_cfg, cfg, _, _ = bench.bench_configs(["--tiny", "--train.grad_accum=2"])
    with pytest.raises(ConfigError, match="train.grad_accum=2: tjax bench times one step"):
        bench.training_setup(model_cfg, cfg)
    with pytest.raises(ConfigError, match="drop --train.grad_accum"):
        bench.main(["--tiny", "--train.grad_accum=2"])


@pytest.mark.slow
def test_gpu_benchmark_tiny_runs_on_cpu(tmp_path, capsys):
    gpu = load_benchmark("gpu")
    out = tmp_path / "gpu.json"
    # probing at the tiny search's largest batch (16) compiles the step once, not twice: the
    # search still predicts the largest batch from the probe's compiled memory
    assert gpu.main(["--tiny", "--steps", "1", "--decode-tokens", "4", "--probe-batch", "16",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    training = result["training"]
    for key in ("batch_size", "tokens_per_s", "flops_per_token", "mfu_vs_measured_bf16",
                "measured_bf16_matmul_peak", "compile_s", "step_ms_median"):
        assert _positive(training[key]), key
    assert "mfu_vs_datasheet_bf16" in training  # None on CPU: no datasheet peak
    search = training["batch_search"]
    assert search and all({"batch", "fits"} <= set(probe) for probe in search)
    assert training["batch_size"] == max(p["batch"] for p in search if p["fits"])
    assert result["model"]["dtype"] == "bfloat16" and result["model"]["param_dtype"] == "float32"
    for batch in ("batch_1", "batch_8"):
        assert _positive(result["decoding"][batch]["decode_tokens_per_s"])
    assert result["versions"]["jax"]


def test_gpu_benchmark_refuses_cudnn_without_a_gpu():
    gpu = load_benchmark("gpu")
    if gpu.jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="attention=cudnn runs on gpu \\(backend is .cpu.\\)"):
        gpu.main([])


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_subcommand_answers_help(flag, capsys):
    from transformers_jax import cli

    for command in cli.COMMANDS:
        try:
            code = cli.main([command, flag])
        except SystemExit as stop:  # argparse-based subcommands exit after printing
            code = stop.code
        out = capsys.readouterr().out
        assert code == 0 and ("usage" in out or "options" in out), (command, flag, out[:200])


@pytest.mark.slow
def test_profile_step_self_times_and_a_tiny_profile(monkeypatch, capsys):
    profile = load_benchmark("profile_step")
    events = [  # one thread: a while loop (10 us) holding a fusion (4 us) and a copy (1 us)
        {"ph": "X", "name": "while.3", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "name": "ynn_fusion.7", "ts": 2, "dur": 4, "pid": 1, "tid": 1},
        {"ph": "X", "name": "copy.2", "ts": 7, "dur": 1, "pid": 1, "tid": 1},
        {"ph": "X", "name": "dot.4", "ts": 30, "dur": 3, "pid": 1, "tid": 1},
        # another thread overlaps in time but is not nested: counted whole
        {"ph": "X", "name": "ynn_fusion.9", "ts": 3, "dur": 5, "pid": 1, "tid": 2},
        {"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0, "dur": 20, "pid": 1, "tid": 3},
        {"ph": "i", "name": "instant", "ts": 1, "pid": 1, "tid": 1},
    ]
    times = profile.self_times(events)
    assert times == {"while.3": 5, "ynn_fusion.7": 4, "copy.2": 1, "ynn_fusion.9": 5, "dot.4": 3}
    summary = profile.summarise(times, {"ynn_fusion.7": "f32[8,16]", "ynn_fusion.9": "f32[8,16]",
                                        "dot.4": "f32[16,8]"}, runs=1, top=5)
    assert summary["self_ms_per_run"] == 0.018
    assert summary["plain_dots_by_output_shape_ms"] == [["f32[16,8]", 0.003]]
    assert summary["by_kind_ms"][0] == ["ynn_fusion", 0.009]
    assert summary["library_matmuls_by_output_shape_ms"] == [["f32[8,16]", 0.009]]

    monkeypatch.setenv("TJAX_HOST_MALLOC", "system")  # no re-exec of the test process
    profile.main(["--tiny", "--runs", "1", "--top", "5"])
    result = json.loads(capsys.readouterr().out)
    assert result["training_step"]["batch_size"] == int(bench.TINY_TRAIN["batch_size"])
    assert result["self_ms_per_run"] > 0 and len(result["by_kind_ms"]) == 5
    assert any(kind.endswith("fusion") for kind, _ in result["by_kind_ms"])


@pytest.mark.slow
def test_profile_step_compile_anatomy(monkeypatch, capsys):
    """The compile phases and the kernel compiles by model part, from a hand-made trace; then
    a real (tiny) compile profiled end to end."""
    profile = load_benchmark("profile_step")
    meta = 'metadata={{op_name="jit(train_step)/{}"}}'.format
    hlo = "\n".join([
        "ENTRY %main {",
        f"  %fusion.1 = f32[8]{{0}} fusion(%a), kind=kLoop, calls=%f1, "
        f"{meta('jvp(GPT)/stack/layer_0/attention/exp')}",
        f"  %add_fusion.2 = f32[8]{{0}} fusion(%b), kind=kLoop, calls=%f2, "
        f"{meta('transpose(jvp(GPT))/stack/layer_0/mlp/up/mul')}",
        f"  ROOT %select_add_fusion.3 = f32[8]{{0}} fusion(%c), kind=kLoop, calls=%f3, "
        f"{meta('add')}",
        "}"])

    def kernel(module, ts, dur):
        return {"ph": "X", "name": "FusionCompiler::Compile", "ts": ts, "dur": dur, "pid": 1,
                "tid": 1, "args": {"module": module}}

    events = [
        {"ph": "X", "name": "HLO passes through layout assignment (jit_train_step)", "ts": 0,
         "dur": 3000, "pid": 1, "tid": 1},
        kernel("fusion.1_kernel_module", 10, 2000),
        kernel("__compute_module_add_fusion.2", 20, 1000),
        kernel("select_add_fusion.3_kernel_module", 30, 500),
        kernel("wrapped_scatter", 40, 500),  # no such instruction: unnamed
        {"ph": "X", "name": "JitCompiler::Compile", "ts": 50, "dur": 4000, "pid": 1, "tid": 2},
    ]
    got = profile.compile_anatomy(events, hlo, top=10)
    assert got["phases_ms"]["HLO passes through layout assignment"] == 3.0
    assert got["phases_ms"]["FusionCompiler::Compile"] == 4.0
    assert got["phase_counts"]["FusionCompiler::Compile"] == 4
    assert got["phases_ms"]["JitCompiler::Compile"] == 4.0
    assert got["kernel_compiles_by_part"] == [
        {"part": "forward attention", "kernels": 1, "ms": 2.0},
        {"part": "backward mlp", "kernels": 1, "ms": 1.0},
        {"part": "optimizer and step", "kernels": 1, "ms": 0.5},
        {"part": "unnamed", "kernels": 1, "ms": 0.5}]

    monkeypatch.setenv("TJAX_HOST_MALLOC", "system")  # no re-exec of the test process
    # in this process: the persistent cache is turned off for the compile and put back after
    profile.main(["--compile", "--tiny", "--top", "5"])
    result = json.loads(capsys.readouterr().out)
    assert result["trace_s"] > 0 and result["compile_s"] > 0 and result["fusions"] > 0
    assert jax.config.jax_enable_compilation_cache  # restored
    # the kernel compiles by the names of the compiler users run (the suite's cheap kernels
    # are named otherwise), in processes of their own; twice: the second time the persistent
    # cache holds the program, which --compile must compile again all the same
    script = str(Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py")
    for _ in range(2):
        done = subprocess.run([sys.executable, script, "--compile", "--tiny", "--top", "5"],
                              env=user_compile_env(), capture_output=True, text=True,
                              check=True)
        result = json.loads(done.stdout)
        assert result["trace_s"] > 0 and result["compile_s"] > 0 and result["fusions"] > 0
        assert result["phase_counts"]["FusionCompiler::Compile"] > 0
        parts = {row["part"] for row in result["kernel_compiles_by_part"]}
        assert "optimizer and step" in parts or len(parts) == 5
