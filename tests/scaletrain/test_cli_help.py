"""The command line explains itself: a version, a user's description, and help for every flag."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from test_cli import scaletrain

from scaletrain.app.cli import build_parser


def every_parser(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("scaletrain",)
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser of every command and subcommand, by its command line."""
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_parser(sub, (*path, name))


def test_every_flag_of_every_command_says_what_it_does():
    silent = [
        f"{command} {action.option_strings[-1]}"
        for command, parser in every_parser(build_parser())
        for action in parser._actions
        if action.option_strings and not action.help
    ]
    assert silent == []


def test_no_help_shows_an_empty_default():
    for command, parser in every_parser(build_parser()):
        assert "(default )" not in parser.format_help(), command


def test_the_version_is_one_line_and_the_help_speaks_to_a_user():
    version = scaletrain("--version")
    assert version.returncode == 0 and version.stdout.strip().startswith("scaletrain 0.")
    described = scaletrain("--help").stdout
    assert "argument parsing" not in described and "Train Llama-style models" in described


# The commands that print results rather than serve or write credentials.
RESULTS = (
    "run",
    "chaos",
    "plan",
    "telemetry",
    "data prepare",
    "data example",
    "ckpt ls",
    "ckpt show",
    "ckpt verify",
    "ckpt export",
)


def test_every_command_that_prints_results_can_print_them_as_json():
    parsers = dict(every_parser(build_parser()))
    missing = [
        command
        for command in RESULTS
        if "--json" not in parsers[f"scaletrain {command}"]._option_string_actions
    ]
    assert missing == []
