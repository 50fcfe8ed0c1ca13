"""The command line every subcommand shares (``overrides.CommandParser``): help lines with
defaults, typos answered with the closest valid option, one exit code (2) for bad input."""

import dataclasses

import pytest

from transformers_jax import cli
from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.overrides import CommandParser, field_help


class _Captured(Exception):
    pass


def subcommand_parsers(monkeypatch) -> dict[str, CommandParser]:
    """Each subcommand's parser, caught as the subcommand starts to parse its arguments."""
    found = {}

    def capture(self, argv):
        found[command] = self
        raise _Captured

    monkeypatch.setattr(CommandParser, "parse", capture)
    for command in cli.COMMANDS:
        with pytest.raises(_Captured):
            cli.COMMANDS[command]([])
    return found


def misspell(option: str) -> str:
    """Swap two letters in the middle of the name: a typo difflib should still place."""
    i = len(option) // 2
    return option[:i] + option[i + 1] + option[i] + option[i + 2:]


def test_every_config_field_has_a_help_line_in_train_help(capsys):
    for cls in (ModelConfig, TrainConfig):
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        helps = field_help(cls)
        assert names <= set(helps), f"fields without a comment: {sorted(names - set(helps))}"
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert "--model.d_model=128" in out and "width of the residual stream" in out
    assert "--train.learning_rate=0.002" in out and "peak of the warmup-cosine" in out
    assert "position=t5: --model.position.num_buckets=32" in out


def test_every_subcommand_option_has_help_and_typos_get_the_closest(monkeypatch, capsys):
    parsers = subcommand_parsers(monkeypatch)
    monkeypatch.undo()
    assert set(parsers) == set(cli.COMMANDS)
    for command, parser in parsers.items():
        options = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
        for action in options:
            assert action.help, f"tjax {command} {action.option_strings}: no help line"
        longest = max((s for a in options for s in a.option_strings),
                      key=len, default="--train.learning_rate")  # train: overrides only
        try:
            code = cli.main([command, misspell(longest), "1"])
        except SystemExit as stop:  # argparse's own exit
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2, command
        assert f"did you mean {longest}?" in err, (command, err)


def test_train_and_bench_share_the_override_grammar(capsys):
    from transformers_jax.bench import bench_parser

    argv = ["--model.position=t5", "--model.position.num_buckets", "16", "--steps=3",
            "--no-progress"]
    _, train_over, _ = cli.train_parser().parse(argv)
    _, bench_over, _ = bench_parser().parse(argv)
    assert train_over == bench_over == {
        "model.position": "t5", "model.position.num_buckets": "16", "train.steps": "3",
        "train.progress": "false"}
    rc = cli.main(["train", "--model.d_modle=3"])
    assert rc == 2 and "did you mean --model.d_model?" in capsys.readouterr().err
    rc = cli.main(["train", "--model.d_model=wide"])
    assert rc == 2 and "model.d_model='wide': expected a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--run", "r", "--lengths", "0"],
     "tjax eval: error: argument --lengths: '0': expected positive numbers like 128,256 "
     "(tjax eval --help lists the options)"),
    (["sample"], "tjax sample: error: the following arguments are required: --run "
                 "(tjax sample --help lists the options)"),
])
def test_a_bad_value_is_one_line_without_the_usage(argv, message, capsys):
    """argparse prints the whole usage (9 lines for tjax eval) before the error, which buries
    it: one line instead, pointing to --help."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == message + "\n"
