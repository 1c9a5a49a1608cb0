"""Writes docs/cli-reference.md from the argparse definitions themselves, so the reference cannot
drift from the options: `.venv/bin/python docs/cli_reference.py` (tests/test_docs.py fails when the
committed file differs from what this writes)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT = Path(__file__).with_name("cli-reference.md")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


ROOT = Path(__file__).resolve().parents[1]


def _default(action: argparse.Action) -> str:
    """The default as written in the definitions: paths inside the checkout relative to it; none
    shown for keys and secrets (their defaults come from the environment)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.default in (
            None, [], argparse.SUPPRESS) or "key" in action.dest or "secret" in action.dest:
        return ""
    value = str(action.default)
    if value.startswith(str(ROOT) + "/"):
        value = value[len(str(ROOT)) + 1:]
    return f"`{value}`"


def _help(action: argparse.Action) -> str:
    """The help text as `--help` prints it (argparse's %(default)s and the like filled in)."""
    text = action.help or ""
    try:
        return text % {**vars(action), "prog": "sloserve"}
    except (KeyError, TypeError, ValueError):
        return text


def _option(action: argparse.Action) -> str:
    names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.dest}`"
    if action.choices is not None and not isinstance(action.choices, dict):
        names += " {" + ", ".join(map(str, action.choices)) + "}"
    elif action.metavar and action.nargs != 0:
        names += f" {action.metavar}" if isinstance(action.metavar, str) else ""
    return names


def _command(lines: list[str], name: str, parser: argparse.ArgumentParser) -> None:
    lines += [f"## `sloserve {name}`", ""]
    if parser.description:
        lines += [parser.description.strip(), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        if group.title == "positional arguments":
            lines += ["**arguments**", ""]
        elif group.title not in ("options", "optional arguments"):
            lines += [f"**{group.title}**", ""]
        lines += ["| option | default | meaning |", "|---|---|---|"]
        lines += [f"| {_cell(_option(a))} | {_cell(_default(a))} | {_cell(_help(a))} |" for a in actions]
        lines.append("")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                _command(lines, f"{name} {sub}", subparser)


def render() -> str:
    from sloserve.cli import build_parser

    parser = build_parser()
    lines = ["# Command-line reference", "",
             "Generated from the argparse definitions by `docs/cli_reference.py`; do not edit by hand.", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _command(lines, name, sub)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {OUT}\n")
