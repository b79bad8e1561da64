"""The command's help texts: `jaxgpt --help` is a user's list of commands, a command's help shows
its defaults."""

import argparse

import pytest

from jaxgpt.cli import build_parser, main

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
