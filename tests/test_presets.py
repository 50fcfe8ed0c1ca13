"""Named models (``presets.py``): exact parameter counts three ways (the stored number, our
model's ``jax.eval_shape``, the Hugging Face model built on the ``meta`` device from the config our
converter writes), the Hugging Face round trip, composition with every override, the CLI, and the
``RUN_DIR/README.md`` a run leaves."""

import json
import re

import pytest

from transformers_jax import ModelConfig
from transformers_jax.cli import build_configs, main
from transformers_jax.config import ConfigError, from_dict
from transformers_jax.convert import hf_config_for
from transformers_jax.convert.common import ARCHITECTURES, param_shapes
from transformers_jax.nn.layers import count_params
from transformers_jax.presets import PRESETS, get_preset, human_count, presets_table
from transformers_jax.registry import ATTENTION, MASKS, POSITIONS
from transformers_jax.runs.meta import read_run_meta
from transformers_jax.runs.readme import CONFIG_FILE, run_readme

NAMES = list(PRESETS)
PUBLISHED = [name for name, p in PRESETS.items() if p.published]
UNITS = {"K": 1e3, "M": 1e6, "B": 1e9}


def test_the_issue_asks_for_these_presets():
    wanted = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-tiny", "bert-mini",
              "bert-small", "bert-medium", "bert-base", "bert-large", "t5-small", "t5-base",
              "t5-v1_1-small", "t5-v1_1-base", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b"}
    assert wanted <= set(PRESETS)
    assert sum(p.cpu for p in PRESETS.values()) >= 3


@pytest.mark.parametrize("name", [  # the quick tier counts the CPU-sized presets
    pytest.param(name, marks=() if PRESETS[name].cpu else pytest.mark.slow) for name in NAMES])
def test_stored_count_is_our_models_count(name):
    """``jax.eval_shape`` of the init: nothing is allocated, so 8B is as cheap as 1M. Tracing
    48 unrolled layers still takes seconds, so the big ones count the scanned stack (the same
    parameters, stacked); the rest count the model exactly as the preset builds it."""
    config = ModelConfig.preset(name)
    if PRESETS[name].params > 400e6:
        config = config.replace(scan_layers=True)
    assert count_params(param_shapes(config)) == PRESETS[name].params


@pytest.mark.parametrize("name", NAMES)
def test_round_trips_through_the_hugging_face_config_unchanged(name):
    preset = PRESETS[name]
    config = ModelConfig.preset(name)
    arch, hf = hf_config_for(config, architecture=preset.hf_model_type)
    assert hf["architectures"] == [preset.hf_class]
    assert arch.config_from_hf(hf) == config  # exactly, not just the same function
    assert ARCHITECTURES.get(preset.hf_model_type) is arch


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_count_equals_the_hugging_face_models(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    preset = PRESETS[name]
    config = ModelConfig.preset(name)
    _, hf = hf_config_for(config, architecture=preset.hf_model_type)
    hf_config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = getattr(transformers, preset.hf_class)(hf_config)
        if preset.hf_model_type == "t5" and not config.tie_embeddings:
            # transformers 5's T5 ties the head to the shared embedding when built from a
            # config, whatever tie_word_embeddings says, and gives it its own tensor when a
            # checkpoint holds a different lm_head (T5 v1.1): the layout of the loaded model.
            assert model.lm_head.weight is model.shared.weight
            model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
    # parameters() yields a tied tensor once; buffers (GPT-2's causal mask) are not parameters
    assert sum(p.numel() for p in model.parameters()) == preset.params


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_rounded_figure_is_close(name):
    """Published figures are rounded (or truncated: GPT-2 XL "1.5B"), and BERT's count the
    pooler instead of the MLM head: within 5%, which a missing layer or table would break."""
    preset = PRESETS[name]
    match = re.fullmatch(r"([\d.]+)([KMB])", preset.published)
    published = float(match[1]) * UNITS[match[2]]
    assert abs(preset.params - published) / published < 0.05, (preset.params, published)
    assert preset.source


def test_every_preset_says_where_it_comes_from():
    for preset in PRESETS.values():
        assert preset.source and preset.hf_class
        if not preset.cpu and preset.published is None:
            assert "no parameter count" in preset.source  # said, not left blank


def test_preset_overrides_compose_in_python_and_on_the_command_line():
    alibi = ModelConfig.preset("gpt2", position="alibi")
    assert alibi.position.name == "alibi"
    assert alibi.replace(position="learned") == ModelConfig.preset("gpt2")
    model, train = build_configs(["--preset", "gpt2", "--model.position=alibi", "--steps", "3"])
    assert model == alibi and train.steps == 3
    model, _ = build_configs(["--preset=llama-3.2-1b", "--model.position.scaling.factor=16",
                              "--model.n_layers=2"])
    assert model.position.scaling.factor == 16.0 and model.n_layers == 2
    assert model.replace(n_layers=16) == ModelConfig.preset(
        "llama-3.2-1b", position={**ModelConfig.preset("llama-3.2-1b").position.to_dict(),
                                  "scaling": {"name": "llama3", "factor": 16.0,
                                              "original_max_len": 8192}})
    # a preset's own mask stays (the family default would drop Mistral's window) ...
    model, _ = build_configs(["--preset", "mistral-7b"])
    assert model == ModelConfig.preset("mistral-7b") and model.mask.window == 4096
    # ... unless the family changes
    model, _ = build_configs(["--preset", "gpt2-cpu", "--family", "bert"])
    assert model.family == "bert" and model.mask.name == "bidirectional"


@pytest.mark.parametrize("field", ["position", "mask", "attention"])
def test_every_switch_composes_with_a_preset(field):
    """Each registered entry of each switch replaces the preset's and leaves the rest as is
    (the ones a layout cannot serve are refused by name, as without a preset)."""
    registry = {"position": POSITIONS, "mask": MASKS, "attention": ATTENTION}[field]
    base = ModelConfig.preset("llama-cpu")
    built = 0
    for name in registry.names():
        try:
            model, _ = build_configs(["--preset", "llama-cpu", f"--model.{field}={name}"])
        except ConfigError as err:  # sliding_window needs its window: the error says so
            assert f"--model.{field}." in str(err), (name, err)
            continue
        assert getattr(model, field).name == name
        assert model.replace(**{field: getattr(base, field)}) == base
        built += 1
    assert built >= len(registry.names()) - 1


def test_bench_takes_a_preset_before_its_overrides():
    from transformers_jax.bench import DEFAULT_TRAIN, TINY_TRAIN, bench_configs

    model, cfg, options, preset = bench_configs(["--preset", "llama-cpu", "--tiny",
                                                 "--model.position=alibi", "--no-decode"])
    assert model == ModelConfig.preset("llama-cpu", position="alibi") and preset == "llama-cpu"
    assert cfg.steps == int(TINY_TRAIN["steps"]) and options.tiny and options.no_decode
    model, cfg, _, preset = bench_configs(["--preset=bert-cpu"])
    assert model == ModelConfig.preset("bert-cpu") and cfg == DEFAULT_TRAIN and preset == "bert-cpu"


def test_preset_errors_are_clear(tmp_path, capsys):
    with pytest.raises(ConfigError, match="did you mean 'llama-3.2-1b'"):
        ModelConfig.preset("lama-3.2-1b")
    with pytest.raises(ConfigError, match="'gpt2-small'"):
        build_configs(["--preset", "gpt2-smal"])
    for argv, message in ((["--preset", "--steps", "3"], "--preset: expected one argument"),
                          (["--preset", "gpt2", "--preset", "bert-base"], "given twice")):
        with pytest.raises(SystemExit) as stop:
            build_configs(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"d_model": 64}}))
    with pytest.raises(ConfigError, match="give the model one way"):
        build_configs(["--preset", "gpt2", "--config", str(config)])
    assert get_preset("GPT2-Small") is PRESETS["gpt2"]  # aliases, any case
    assert main(["train", "--preset", "nope"]) == 2


def test_tjax_presets_lists_every_preset_with_its_count(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for preset in PRESETS.values():
        row = next(line for line in out.splitlines() if line.startswith(preset.name + " "))
        assert f"{preset.params:,}" in row and human_count(preset.params) in row
    assert out == presets_table() + "\n"
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == NAMES
    assert {r["name"]: r["params"] for r in rows}["llama-3.1-8b"] == 8_030_261_248
    assert ModelConfig(**rows[0]["model"]) == ModelConfig.preset(rows[0]["name"])
    assert human_count(124_439_808) == "124.4M" and human_count(8_030_261_248) == "8.03B"


def test_the_guides_excerpt_is_the_real_table():
    from pathlib import Path

    guide = (Path(__file__).parent.parent / "docs" / "conversion.md").read_text()
    section = guide.split("## Named models: presets", 1)[1]
    excerpt = section.split("An excerpt of the table:", 1)[1].split("```", 2)[1]
    excerpt = excerpt.strip().splitlines()
    table = presets_table().splitlines()
    assert len(excerpt) >= 5 and all(line in table for line in excerpt), excerpt


def _final(params: int) -> dict:
    return {"steps": 5, "params": params, "train_loss": 2.5, "eval_loss": 2.25,
            "eval_accuracy": 0.5, "tokens_per_s": 1000.0, "mfu": 0.01, "stopped_by": None}


@pytest.mark.parametrize(("name", "use", "hf_class"), [
    ("bert-cpu", "tjax fill-mask --run", "BertForMaskedLM"),
    ("t5-cpu", "tjax sample --run", "T5ForConditionalGeneration")])
def test_run_readme_names_the_commands_that_fit_the_family(name, use, hf_class):
    from transformers_jax.config import TrainConfig
    from transformers_jax.convert.api import export_class

    cfg = ModelConfig.preset(name, dropout=0.1)

    def readme(**kw):
        return run_readme("runs/x y", cfg, TrainConfig(steps=5, task="reverse"),
                          _final(PRESETS[name].params), data_description="reverse task",
                          tokenizer="byte", preset=name, **kw)

    text = readme(hf_class=export_class(cfg))
    assert f"- preset: `{name}`; changed: `dropout=0.1`" in text
    assert use in text and "tjax eval --run 'runs/x y'" in text
    assert ("tjax sample" in text) == (name != "bert-cpu")
    assert "| 2.5000 | 2.2500 | 0.5000 | 1,000 | 1.00% |" in text
    # the export among the commands, as the converter names it; none where it would refuse
    use_block = text.split("## Use it")[1].split("```")[1]
    assert (f"tjax convert --to-hf 'runs/x y-hf' --run 'runs/x y'   # a Hugging Face "
            f"{hf_class} (transformers loads it)") in use_block.splitlines()
    assert "tjax convert" not in readme(hf_class=None)
    assert export_class(ModelConfig()) is None  # the default GPT: no architecture takes it


@pytest.mark.slow
def test_train_writes_a_readme_that_reproduces_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--preset", "gpt2-cpu", "--model.n_layers=1", "--steps", "4",
            "--train.seq_len=32", "--train.batch_size=4", "--train.eval_every=4",
            "--train.eval_batches=1", "--run-dir", str(run), "--no-progress", "--json"]
    assert main(argv) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = (run / "README.md").read_text()
    assert "# gpt2-cpu run" in text and "- preset: `gpt2-cpu`; changed: `n_layers=1`" in text
    assert f"- parameters: {final['params']:,}" in text
    assert f"| {final['train_loss']:.4f} | {final['eval_loss']:.4f} |" in text
    assert "tjax " + " ".join(argv) in text  # the exact command (no quoting needed here)
    assert f"tjax sample --run {run}" in text and f"tjax eval --run {run}" in text
    # the full configs reproduce the same model and settings through --config
    model, train = build_configs(["--config", str(run / CONFIG_FILE)])
    saved = json.loads((run / CONFIG_FILE).read_text())
    assert model == from_dict(ModelConfig, saved["model"])
    assert model == ModelConfig.preset("gpt2-cpu", n_layers=1) and train.steps == 4
    assert read_run_meta(str(run))["preset"] == "gpt2-cpu"  # a record beside the config
    # resuming through the saved config (no --preset) continues the same run and keeps the
    # record; the README is rewritten for the new end
    assert main(["train", "--config", str(run / CONFIG_FILE), "--steps", "5", "--json"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert final["steps"] == 5 and read_run_meta(str(run))["preset"] == "gpt2-cpu"
    text = (run / "README.md").read_text()
    assert "5 of 5 steps" in text and "- preset: `gpt2-cpu`; changed: `n_layers=1`" in text
    assert f"tjax train --config {run / CONFIG_FILE} --steps 5 --json" in text
