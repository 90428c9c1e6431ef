"""`tollgate --help`: every command and subcommand says in one line what it does."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tollgate.app.cli import build_parser, scaler_status_parser

# what fits beside the names in an 80-column terminal
MAX_SUMMARY = 62


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, argparse.ArgumentParser, str]]:
    """(command path, its parent, its parser, its summary in the parent's list), depth first."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        summaries = {a.dest: a.help for a in action._choices_actions}
        for name, child in action.choices.items():
            yield (*path, name), parser, child, summaries.get(name) or ""
            yield from commands(child, (*path, name))


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    root = build_parser()
    found = [("tollgate", root)]
    found += [(" ".join(path), child) for path, _, child, _ in commands(root)]
    found.append(("scaler status", scaler_status_parser()))
    return found


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def test_the_walk_reaches_every_level() -> None:
    paths = {path for path, *_ in commands(build_parser())}
    assert {("up",), ("keys", "create"), ("usage", "report"), ("bus", "certs")} <= paths


def test_every_subcommand_has_a_one_line_summary_shown_by_its_help() -> None:
    problems = []
    for path, parent, child, summary in commands(build_parser()):
        name = " ".join(path)
        if not summary or "\n" in summary or len(summary) > MAX_SUMMARY:
            problems.append(f"{name}: summary {summary!r} is not one short line")
            continue
        if child.description != summary:
            problems.append(f"{name}: --help says {child.description!r}, not its summary")
        # listed in the parent's --help with its name, on one line
        listing = parent.format_help().splitlines()
        if not any(line.split() == [path[-1], *summary.split()] for line in listing):
            problems.append(f"{name}: not on one line in the parent's help:\n{listing}")
    assert not problems, "\n".join(problems)


def test_every_command_says_what_it_does_and_every_option_what_it_is() -> None:
    problems = []
    for name, parser in every_parser():
        description = parser.description or ""
        if not description or "\n" in description or len(description) > 78:
            problems.append(f"{name}: no one-line description")
        if description and description not in " ".join(parser.format_help().split()):
            problems.append(f"{name}: --help does not show its description")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or "-h" in action.option_strings:
                continue
            if not action.help:
                problems.append(f"{name}: {action.option_strings or action.dest} has no help")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "argv", [[], ["keys"], ["keys", "create"], ["bus", "identities"], ["scaler", "status"]]
)
def test_the_real_command_prints_its_summary(argv: list[str]) -> None:
    parsers = dict(every_parser())
    expected = parsers[" ".join(argv) or "tollgate"].description
    done = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # usage first, then the one-line description
    paragraphs = done.stdout.split("\n\n")
    assert paragraphs[0].startswith(f"usage: tollgate {' '.join(argv)}".rstrip())
    assert paragraphs[1] == expected, done.stdout
