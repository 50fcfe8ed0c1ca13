"""The README and the guides in docs/ cannot go stale: every `tjax` command they show parses
(options, and for `train` and `bench` the whole config they build), every error they quote is
what the CLI prints today (in process, fast; ``test_transcripts`` runs the whole transcripts as
a user would), and the README's switch table is the registries'."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from test_cli import subcommand_parsers
from test_cli_journeys import run_cli
from transcripts import line_matches

from transformers_jax import ModelConfig, cli, train_options
from transformers_jax.bench import bench_configs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)


def readme_commands() -> list[list[str]]:
    """Each `tjax ...` line of a fenced block (continuations joined, comments dropped), as argv
    after `tjax`, excluding the transcript commands (`$ tjax ...`), checked by their output."""
    commands = []
    for block in (b for doc in DOCUMENTS for b in fenced_blocks(doc.read_text())):
        for line in block.replace("\\\n", " ").splitlines():
            if re.match(r"tjax [\w-]+( |$)", line):  # not an error line, "tjax train: ..."
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def readme_errors() -> list[tuple[list[str], str]]:
    """``$ tjax ...`` lines followed by the ``tjax X: error: ...`` line the README quotes."""
    pairs = []
    for block in (b for doc in DOCUMENTS for b in fenced_blocks(doc.read_text())):
        lines = block.splitlines()
        for command, output in zip(lines, lines[1:], strict=False):
            if command.startswith("$ tjax ") and re.match(r"tjax [\w-]+: error: ", output):
                pairs.append((shlex.split(command[2:])[1:], output))
    return pairs


COMMANDS = readme_commands()
ERRORS = readme_errors()


def test_the_readme_shows_commands_and_errors():
    assert len(COMMANDS) >= 20 and len(ERRORS) >= 2  # the extraction itself works
    assert {argv[0] for argv in COMMANDS} >= {"train", "sample", "eval", "convert", "presets"}


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_every_readme_command_parses(argv, monkeypatch):
    command, rest = argv[0], argv[1:]
    assert command in cli.COMMANDS, f"tjax {command}: no such subcommand"
    if "--help" in rest:  # prints the help and exits 0
        with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
        assert stop.value.code == 0
        return
    if command == "train" and "--config" not in rest:
        # a run the README trains before starting from it (--train.init_from) is not here:
        # a bert model's config stands in for the one saved with it
        monkeypatch.setattr(train_options, "model_of_run", lambda run: run and ModelConfig(
            family="bert", mask="bidirectional").to_dict())
        cli.build_configs(rest)  # validates every value, as tjax train does before it starts
    elif command == "bench":
        bench_configs(rest)
    else:
        parser = subcommand_parsers(monkeypatch)[command]
        monkeypatch.undo()
        parser.parse(rest)


@pytest.mark.parametrize("argv, printed", ERRORS, ids=[" ".join(a)[:60] for a, _ in ERRORS])
def test_every_error_the_readme_quotes_is_printed_today(argv, printed):
    code, err = run_cli(argv)
    assert code == 2
    assert any(line_matches(printed, line) for line in err.splitlines()), (
        f"README quotes:\n{printed}\ntjax {' '.join(argv)} prints today:\n{err}")


def test_the_readme_switch_table_is_the_registries():
    """Regenerate with ``python tests/readme_tables.py`` after registering an entry."""
    from readme_tables import readme_table, switch_table

    assert readme_table(README.read_text()) == switch_table()


def test_the_readme_stays_short_and_links_guides_that_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    # the standing figures with their commands; history lives in git
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 300
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", text):
        assert (ROOT / link).exists(), link


def test_the_layout_lists_every_subcommand():
    """The README's layout names every ``tjax`` subcommand on its ``cli.py`` line (three were
    missing once: corpus, tokenizer, merge)."""
    layout = README.read_text().split("  cli.py ", 1)[1].split("\ntests/", 1)[0]
    listed = set(re.findall(r"[\w-]+", layout.split("tjax", 1)[1]))
    assert listed == set(cli.COMMANDS), sorted(listed ^ set(cli.COMMANDS))
