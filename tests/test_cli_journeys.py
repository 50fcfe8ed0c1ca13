"""What a new user types first works from the command line with its defaults: each family's
command as the README's family table gives it, every registered synthetic task, and a
``--config`` file that is wrong in any way is refused with the file named."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from transformers_jax import cli
from transformers_jax.config import SHUFFLE_ROWS, ConfigError, TrainConfig
from transformers_jax.data.synthetic import TASKS
from transformers_jax.registry import FAMILIES

README = Path(__file__).resolve().parents[1] / "README.md"
# the shortest run that still trains, evaluates and samples: the defaults are what is tested
SHORT = ["--steps", "2", "--train.eval_batches", "1", "--no-progress"]
TINY = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2"]


def family_table_commands() -> dict[str, list[str]]:
    """``{family: argv}`` from the README's family table (its last column, "runs out of the
    box")."""
    found = {}
    for row in README.read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 4 and (name := re.match(r"`(\w+)`", cells[0])):
            command = re.search(r"`(tjax train[^`]*)`", cells[-1])
            if command and name.group(1) in FAMILIES:
                found[name.group(1)] = shlex.split(command.group(1))[2:]
    return found


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


def test_the_readme_family_table_gives_a_command_for_every_family():
    assert set(family_table_commands()) == set(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(family_table_commands()))
def test_every_readme_family_command_trains_with_its_defaults(family):
    code, err = run_cli(["train", *family_table_commands()[family], *SHORT])
    assert code == 0, err
    assert "done: step 2" in err


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_takes_the_default_shuffle(task):
    """The text default (shuffled rows) must not make --task refuse an option nobody gave."""
    _, cfg = cli.build_configs(["--task", task])
    assert cfg.shuffle_rows == 0
    _, cfg = cli.build_configs(["--task", task, "--family", "encdec"])
    assert cfg.shuffle_rows == 0
    _, cfg = cli.build_configs(["--preset", "t5-cpu", "--task", task])
    assert cfg.shuffle_rows == 0


def test_shuffle_rows_follows_the_data_kind_both_ways(tmp_path):
    assert TrainConfig().shuffle_rows == SHUFFLE_ROWS
    config = tmp_path / "task.json"
    config.write_text(json.dumps({"train": {"task": "copy"}}))
    _, cfg = cli.build_configs(["--config", str(config), "--train.task=none"])
    assert cfg.task is None and cfg.shuffle_rows == SHUFFLE_ROWS  # back to text: shuffled
    _, cfg = cli.build_configs(["--task", "copy", "--train.shuffle_rows=0"])
    assert cfg.shuffle_rows == 0
    with pytest.raises(ConfigError, match="drop --train.shuffle_rows"):  # asked for: refused
        cli.build_configs(["--task", "copy", "--train.shuffle_rows=64"])


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_trains_from_the_command_line(task):
    code, err = run_cli(["train", "--task", task, *TINY, *SHORT])
    assert code == 0, err
    assert "done: step 2" in err


@pytest.mark.parametrize("content, message", [
    ('{"trian": {"steps": 3}}',
     "unknown section 'trian'; did you mean 'train'? the sections are 'model', 'train'"),
    ('{"train": {\n "steps": 3,\n}}', "not valid JSON at line 3, column 1"),
    ('[1, 2]', "expected a JSON object"),
    ('{"model": "gpt"}', "section 'model' must be a JSON object of fields"),
])
def test_a_bad_config_file_is_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    for command in ("train", "bench"):
        code, err = run_cli([command, "--config", str(path)])
        assert code == 2
        assert f"tjax {command}: error: --config {path}: " in err and message in err, err
        assert "Traceback" not in err


def test_a_missing_config_file_says_so(tmp_path):
    code, err = run_cli(["train", "--config", str(tmp_path / "missing.json")])
    assert code == 2
    assert err.strip().endswith(f"--config {tmp_path / 'missing.json'}: no such file")


def test_a_saved_run_config_is_a_valid_config_file(tmp_path):
    """RUN_DIR/tjax_config.json may be passed back as --config (its record keys are kept)."""
    path = tmp_path / "tjax_config.json"
    path.write_text(json.dumps({"preset": None, "model": {"d_model": 64},
                                "train": {"steps": 7}}))
    model_cfg, cfg = cli.build_configs(["--config", str(path)])
    assert model_cfg.d_model == 64 and cfg.steps == 7


def test_bench_reads_the_config_file(tmp_path):
    from transformers_jax.bench import bench_configs

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"model": {"n_layers": 2}, "train": {"batch_size": 4}}))
    model_cfg, cfg, _, _ = bench_configs(["--config", str(path), "--model.d_model=64"])
    assert (model_cfg.n_layers, model_cfg.d_model, cfg.batch_size) == (2, 64, 4)


def run_cli_out(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def test_help_lists_every_registered_name_of_a_named_field(capsys):
    from transformers_jax.config import NAMED_FIELDS

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for field, registry in NAMED_FIELDS.items():
        line = next(x for x in lines if re.match(rf"\s+--(model|train)\.{field}=", x))
        assert line.endswith(f"(one of: {', '.join(registry.selectable())})"), line
    # a switch lists its entries under its option, each with its settings
    assert {"      mlp=geglu", "      mlp=gelu_exact", "      norm_position=post"} <= set(lines)
    assert "      norm=rmsnorm: --model.norm.eps=1e-05" in lines


def test_a_preset_name_given_as_a_family_points_to_preset():
    code, err = run_cli(["train", "--family", "gpt2", "--steps", "1"])
    assert code == 2
    assert "'gpt2' is a named model, not a family; use --preset gpt2" in err
    code, err = run_cli(["train", "--family", "gtp", "--steps", "1"])
    assert code == 2 and "did you mean 'gpt'?" in err


def test_too_little_text_suggests_lines(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("hello world\n" * 200)
    code, err = run_cli(["train", "--data", str(text), "--steps", "1",
                         "--train.data_dir", str(tmp_path / "prepared")])
    assert code == 2 and f"--data lines:{text}" in err, err
    assert "val_fraction=0" not in err  # a value the config refuses


def test_preparing_local_text_leaves_no_temporary_folders(tmp_path, monkeypatch):
    import tempfile

    from transformers_jax.data.local_text import prepare_local_text

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    text = tmp_path / "doc.txt"
    text.write_text("some text to prepare\n" * 50)
    prepare_local_text(str(text), "file", str(tmp_path / "prepared"))
    assert list(scratch.iterdir()) == []


@pytest.fixture(scope="module")
def short_table_run(tmp_path_factory):
    """A GPT whose learned position table has 64 rows: fewer than the default 200 new tokens."""
    run = tmp_path_factory.mktemp("learned") / "run"
    code, err = run_cli(["train", "--model.position=learned", "--model.max_len=64",
                         "--train.seq_len=32", *TINY, *SHORT, "--run-dir", str(run)])
    assert code == 0, err
    return run


@pytest.mark.slow
def test_sample_caps_the_default_length_at_the_position_table(short_table_run):
    code, out, err = run_cli_out(["sample", "--run", str(short_table_run), "--prompt", "ab",
                                  "--temperature", "0"])
    assert code == 0, err
    assert "generating 62 tokens, all the model's 64 positions leave after the prompt" in err
    assert out.startswith("ab")


@pytest.mark.slow
def test_sample_refuses_a_length_past_the_table_before_printing(short_table_run):
    code, out, err = run_cli_out(["sample", "--run", str(short_table_run), "--prompt", "ab",
                                  "--max-new-tokens", "100"])
    assert code == 2 and out == ""  # nothing echoed: the error has a line of its own
    assert "--max-new-tokens 100: the model has room for 62 after this 2-token prompt" in err
    assert "use --max-new-tokens 62 or less" in err


@pytest.mark.slow
def test_encoder_decoder_samples_show_source_and_output_apart(tmp_path):
    run = tmp_path / "run"
    code, err = run_cli(["train", "--family", "encdec", "--task", "reverse", *TINY, *SHORT,
                         "--run-dir", str(run)])
    assert code == 0, err
    # a task's eval line: its sequence accuracy (greedy exact match), no bits per byte
    evals = [line for line in err.splitlines() if "| eval loss" in line]
    assert evals and all("sequence accuracy" in e and "bits/" not in e for e in evals), evals
    code, out, err = run_cli_out(["sample", "--run", str(run), "--prompt", "abc",
                                  "--max-new-tokens", "8"])
    assert code == 0, err
    assert out.startswith("source: abc\n=> "), out


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("fmt", ["decoder", "encdec"])
def test_the_longest_fitting_task_length_fits_and_one_more_does_not(task, fmt):
    from transformers_jax.data.synthetic import FORMATS, longest_fitting_length

    definition, layout = TASKS.get(task), FORMATS[fmt]

    def fits(n, seq_len=64):
        return all(v <= seq_len for v in layout.row_lengths(*definition.max_chars(n)).values())

    n = longest_fitting_length(task, fmt, (1, 60), 64)
    assert n is not None and fits(n)
    assert n == 60 or not fits(n + 1)


# runs whose READMEs once suggested commands that fail: each family, a position table, the
# randomized positions (which do not decode unless evaluated on the real ones), a task run
# (its prompt an example of the task)
SUGGESTING_RUNS = {
    "gpt": ["--model.position=learned", "--model.max_len=32"],
    "randomized": ["--model.position=randomized", "--model.position.max_position=64"],
    "lstm": ["--family", "lstm"],
    "bert": ["--family", "bert"],
    "encdec_task": ["--family", "encdec", "--task", "reverse"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SUGGESTING_RUNS))
def test_every_command_a_run_readme_suggests_works(name, tmp_path):
    """The README of a run lists the commands that use it: each one runs (exit 0) as shown."""
    import shlex

    run = tmp_path / "run"
    code, err = run_cli(["train", *SUGGESTING_RUNS[name], *TINY, *SHORT, "--train.seq_len=32",
                         "--train.tensorboard=false", "--run-dir", str(run)])
    assert code == 0, err
    readme = (run / "README.md").read_text()
    block = readme.split("## Use it")[1].split("```")[1]
    commands = [shlex.split(line.split("   #")[0]) for line in block.strip().splitlines()]
    assert commands and all(c[0] == "tjax" for c in commands), block
    assert any(c[1] == "eval" for c in commands)
    for command in commands:  # as shown
        code, err = run_cli(command[1:])
        assert code == 0, (command, err[-2000:])
    suggests_sampling = any(c[1] == "sample" for c in commands)
    assert suggests_sampling == (name in ("gpt", "encdec_task")), block
    # the export only where a Hugging Face architecture expresses the model: GPT-2 for the
    # learned position table (run above, as shown); none for RoPE, LSTM, BERT here, T5 here
    exports = [c for c in commands if c[1] == "convert"]
    assert len(exports) == (name == "gpt"), block
    if exports:
        assert json.loads((tmp_path / "run-hf" / "config.json").read_text())["architectures"] == [
            "GPT2LMHeadModel"]
