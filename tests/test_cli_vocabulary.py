"""One CLI vocabulary: every idea the sub-commands share has one spelling in every sub-command's
``--help`` (the one ``twinpipe.cli_options.VOCABULARY`` gives), and the earlier spellings still parse,
hidden, to the same value."""

from __future__ import annotations

import argparse
import re

import pytest

from twinpipe import cli_options
from twinpipe.cli import _parser, main

COMMANDS = [["demo"], ["demo", "--moe"], ["train"], ["simulate"], ["draw"], ["plan"], ["export"], ["eplb"]]
IDS = [" ".join(c) for c in COMMANDS]


def _subparser(command: list[str]) -> argparse.ArgumentParser:
    top = _parser(command[0], command)
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command[0]]


def _help(command: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_help_shows_one_spelling_per_idea(command, capsys):
    text = _help(command, capsys)
    shown = _flags(text)
    old = sorted(set(cli_options.old_spellings()) & shown)
    assert not old, f"twinpipe {' '.join(command)} --help shows old spellings: " + ", ".join(
        f"{o} (now {cli_options.old_spellings()[o]})" for o in old)
    parser = _subparser(command)
    for action in parser._actions:
        name = getattr(action, "vocabulary", None)
        if name is not None:
            option = cli_options.VOCABULARY[name]
            assert option.flag in shown and action.help.startswith(option.words), (command, option.flag)


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_every_shared_idea_comes_from_the_vocabulary(command):
    # An option whose flag or destination is a shared idea's is added by cli_options.add (or is its hidden old spelling).
    parser = _subparser(command)
    flags = {o.flag: name for name, o in cli_options.VOCABULARY.items()} | cli_options.old_spellings()
    for action in parser._actions:
        shared = [s for s in action.option_strings if s in flags] or (action.dest in cli_options.VOCABULARY and action.option_strings)
        if shared:
            assert getattr(action, "vocabulary", None) or action.help == argparse.SUPPRESS, (command, action.option_strings)


def test_every_idea_is_spelled_the_same_in_every_command(capsys):
    # Across commands: each idea a command has shows the same flag, with the same words.
    seen: dict[str, set[str]] = {}
    for command in COMMANDS:
        for action in _subparser(command)._actions:
            name = getattr(action, "vocabulary", None)
            if name is not None:
                seen.setdefault(name, set()).add(action.option_strings[0])
    assert all(len(flags) == 1 for flags in seen.values()), seen
    # the ideas the issue named are shared by several commands
    users = {name: [c for c in COMMANDS if any(getattr(a, "vocabulary", None) == name for a in _subparser(c)._actions)]
             for name in ("pp", "microbatches", "dim", "seq_len", "out")}
    assert all(len(u) >= 3 for u in users.values()), users


OLD = [  # (command, old spelling, new spelling, value)
    (["demo"], "--ranks", "--pp", "3"), (["demo"], "--chunks", "--microbatches", "5"), (["demo"], "--hidden", "--dim", "8"),
    (["demo"], "--seq", "--seq-len", "7"),
    (["demo", "--moe"], "--chunks", "--microbatches", "5"), (["demo", "--moe"], "--hidden", "--dim", "8"),
    (["demo", "--moe"], "--expert-hidden", "--expert-ffn", "9"), (["demo", "--moe"], "--blocks", "--blocks-per-stage", "3"),
    (["train"], "--hidden", "--dim", "8"), (["train"], "--seq", "--seq-len", "7"), (["train"], "--ranks", "--pp", "3"),
    (["train"], "--output", "--out", "x"),
    (["simulate", "1f1b"], "--ranks", "--pp", "3"), (["simulate", "1f1b"], "-p", "--pp", "3"),
    (["simulate", "1f1b"], "-m", "--microbatches", "5"),
    (["draw", "1f1b"], "--output", "--out", "x.png"), (["draw", "1f1b"], "-o", "--out", "x.png"),
    (["draw", "1f1b"], "--ranks", "--pp", "3"),
    (["plan"], "--hidden", "--dim", "8"), (["plan"], "--seq", "--seq-len", "7"), (["plan"], "-m", "--microbatches", "5"),
    (["export", "1f1b"], "--ranks", "--pp", "3"), (["export", "1f1b"], "-m", "--microbatches", "5"),
    (["export", "1f1b"], "-o", "--out", "x.csv"),
]


@pytest.mark.parametrize("command, old, new, value", OLD, ids=[f"{' '.join(c)} {o}" for c, o, _, _ in OLD])
def test_old_spellings_still_parse_to_the_same_value(command, old, new, value):
    top = _parser(command[0], command)
    typed_old, typed_new = top.parse_args([*command, old, value]), top.parse_args([*command, new, value])
    assert vars(typed_old) == vars(typed_new)
    dest = next(a.dest for a in _subparser(command)._actions if new in a.option_strings)
    assert str(getattr(typed_new, dest)) == value


def test_an_old_spelling_gets_a_note_at_a_terminal_only(capsys, monkeypatch):
    top = _parser("simulate", ["simulate"])
    top.parse_args(["simulate", "--ranks", "2"])
    assert capsys.readouterr().err == ""  # scripts and logs: nothing
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    top.parse_args(["simulate", "--ranks", "2"])
    assert "--ranks is now spelled --pp (the old spelling still works)" in capsys.readouterr().err


def test_the_demo_moe_help_is_whole():
    # It was cut after its first line ("... with DualPipeV, its").
    text = " ".join(_subparser(["demo", "--moe"]).format_help().split())
    assert "usage: twinpipe demo --moe" in text and "how much all-to-all time the overlap hid" in text
    assert "--eplb" in text and "--ep EP" in text and "--schedule" not in text


def test_check_names_the_flag_help_shows():
    parser = argparse.ArgumentParser()
    cli_options.add(parser, "pp", default=2)
    cli_options.add(parser, "lr", default=0.1)
    with pytest.raises(ValueError, match=r"^--pp=0: must be >= 1$"):
        cli_options.check(parser.parse_args(["--ranks", "0"]), parser)
    with pytest.raises(ValueError, match=r"^--lr=nan: must be a finite number > 0$"):
        cli_options.check(parser.parse_args(["--lr", "nan"]), parser)
    cli_options.check(parser.parse_args([]), parser)
