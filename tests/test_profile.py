"""--train.profile=START:STEPS: a jax.profiler trace of those steps, checked on CPU (the trace
files exist and name the annotated train steps); a bad value is refused naming the field."""

from __future__ import annotations

import glob
import gzip
import json
import os

import pytest

from transformers_jax import ModelConfig, TrainConfig, bench
from transformers_jax.config import ConfigError, apply_overrides
from transformers_jax.overrides import parse_overrides
from transformers_jax.train.loop import train

TINY_MODEL = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=32)


@pytest.mark.parametrize(("value", "why"), [
    ("5", "must be START:STEPS"), ("a:b", "must be START:STEPS"), ("1:2:3", "START:STEPS"),
    ("", "START:STEPS"), ("3:0", "STEPS >= 1"), ("-1:2", "START >= 0"),
    ("4:1", "START must be below train.steps=4"),
])
def test_a_bad_profile_value_is_refused_naming_the_field(value, why):
    with pytest.raises(ConfigError, match="train.profile=") as err:
        apply_overrides(TrainConfig(steps=4), {"profile": value}, "train.")
    assert why in str(err.value)


def test_profile_is_a_train_option_with_a_short_alias():
    assert parse_overrides(["--profile", "10:3"])[0] == {"train.profile": "10:3"}
    assert apply_overrides(TrainConfig(), {"profile": "10:3"}, "train.").profile == "10:3"
    assert apply_overrides(TrainConfig(), {"profile": "none"}, "train.").profile is None


def traced_steps(log_dir: str) -> tuple[bytes, set[str]]:
    """The trace's xplane bytes and the step numbers of its ``train`` step annotations (from
    the Chrome trace JSON JAX writes beside it, where this JAX writes one)."""
    xplanes = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(xplanes) == 1, os.listdir(log_dir)
    with open(xplanes[0], "rb") as f:
        xplane = f.read()
    steps: set[str] = set()
    for path in glob.glob(os.path.join(os.path.dirname(xplanes[0]), "*.trace.json.gz")):
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
        steps |= {e["args"]["step_num"] for e in events if e.get("name") == "train"}
    return xplane, steps


@pytest.mark.slow
def test_a_training_run_writes_a_trace_of_the_profiled_steps(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps " * 400)
    run_dir = tmp_path / "run"
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, log_every=2, eval_every=4,
                      eval_batches=1, data=str(tmp_path / "text.txt"), run_dir=str(run_dir),
                      tensorboard=False, progress=False, profile="1:2")
    final = train(TINY_MODEL, cfg)
    xplane, steps = traced_steps(str(run_dir / "profile"))
    assert b"train" in xplane  # the step annotation's name
    assert steps in (set(), {"1", "2"})  # exactly the window, where a JSON trace is written
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    said = [row for row in rows if row["kind"] == "profile"]
    assert [row["step"] for row in said] == [1, 2]
    assert {row["profile_dir"] for row in said} == {str(run_dir / "profile")}
    # both MFU conventions: causal attention at half counts fewer FLOPs
    assert 0 < final["flops_per_token_causal_half"] < final["flops_per_token"]
    assert 0 < final["mfu_causal_half"] < final["mfu"]
    assert all("mfu_causal_half" in row for row in final["history"])


@pytest.mark.slow
def test_bench_profile_writes_a_trace(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure_matmul_peak", lambda dtype: 1e11)  # not timed here
    model_cfg, cfg, _, _ = bench.bench_configs(
        ["--tiny", "--profile", "1:1", "--run-dir", str(tmp_path)])
    bench.bench_training(model_cfg, cfg, steps=1, warmup=1)
    xplane, steps = traced_steps(str(tmp_path / "profile"))
    assert b"train" in xplane and steps in (set(), {"1"})
    assert f"traced into {tmp_path / 'profile'}" in capsys.readouterr().err
