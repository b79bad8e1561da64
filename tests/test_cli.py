"""The command's help texts: `jaxgpt --help` is a user's list of commands, a command's help shows
its defaults."""

import argparse

import pytest

from jaxgpt.cli.main import build_parser, main

COMMANDS = ("dry-run", "train", "eval", "generate", "bench", "sweep", "import-hf", "export-hf")


def _help(argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # a common terminal; argparse wraps to it
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_lists_every_command_on_one_line(capsys, monkeypatch):
    text = _help(["--help"], capsys, monkeypatch)
    lines = text.splitlines()
    assert "argument parsing" not in text and "{" not in text  # no docstring, no "{a,b,...}" list
    names = list(_subcommands(build_parser()))
    assert set(COMMANDS) <= set(names)
    for name in names:
        [index] = [i for i, line in enumerate(lines) if line.split()[:1] == [name]]
        line, following = lines[index], lines[index + 1]
        assert len(line.split()) > 2, line  # the command and its help on the same line
        assert not following.startswith(" " * 4), f"{name}'s help runs onto a second line: {following!r}"
    assert "COMMAND --help" in text  # says where each command's options are


def test_generate_help_shows_every_default(capsys, monkeypatch):
    text = _help(["generate", "--help"], capsys, monkeypatch)
    options = text.split("options:", 1)[1]
    generate = _subcommands(build_parser())["generate"]
    for action in generate._actions:
        if action.required or not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[-1]
        block = options.split(flag, 1)[1].split("\n  -", 1)[0]  # this option's help, to the next option
        assert "(default:" in " ".join(block.split()), f"{flag} shows no default: {block!r}"
    assert "(default: 0.8)" in text and "(default: 200)" in text


def _failing(monkeypatch, error):
    import jaxgpt.cli.main as cli

    def command(args):
        raise error

    monkeypatch.setattr(cli, "cmd_dry_run", command)


def test_a_bug_keeps_its_traceback_and_is_never_one_line(monkeypatch, capsys):
    """A ValueError jaxgpt did not raise for the user is a bug: it leaves main as itself."""
    _failing(monkeypatch, ValueError("an index out of step"))
    with pytest.raises(ValueError, match="an index out of step"):
        main(["dry-run"])
    assert "error:" not in capsys.readouterr().err


def test_a_user_error_is_one_line_and_exit_2_and_a_failure_exit_1(monkeypatch, capsys):
    from jaxgpt.errors import Failure, UserError

    _failing(monkeypatch, UserError("model.d_model = 130 is not divisible\nsecond line"))
    assert main(["dry-run"]) == 2
    assert capsys.readouterr().err == "jaxgpt dry-run: error: model.d_model = 130 is not divisible\n"
    _failing(monkeypatch, Failure("encoding worker 1 was killed (SIGKILL); run the command again to continue"))
    assert main(["dry-run"]) == 1
    assert capsys.readouterr().err.startswith("jaxgpt dry-run: error: encoding worker 1 was killed")


def test_jaxgpt_debug_shows_a_user_errors_traceback(monkeypatch, capsys):
    from jaxgpt.errors import UserError

    _failing(monkeypatch, UserError("a refused change"))
    monkeypatch.setenv("JAXGPT_DEBUG", "1")
    assert main(["dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "UserError: a refused change" in err
    assert err.splitlines()[-1] == "jaxgpt dry-run: error: a refused change"
