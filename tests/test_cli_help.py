"""What every `jaxpi` command's --help says: the defaults of its flags, no "%%" left of argparse's
escaping, the demo's stages, the README's flags; and `jaxpi --version`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import jaxpi
from jaxpi.cli import ALL, build_parser, main
from jaxpi.cli.registry import help_for
from jaxpi.configfile.help import describe, show_value

ROOT = Path(__file__).resolve().parents[1]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def every_parser(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator:
    """(command words, parser) of `jaxpi` and every command and subcommand under it."""
    yield path, parser
    for name, child in subcommands(parser).items():
        yield from every_parser(child, (*path, name))


@pytest.fixture(scope="module")
def parsers() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return list(every_parser(build_parser(ALL)))


def action_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The lines --help prints for one argument, unwrapped."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def stated_default(action: argparse.Action, config_defaults: dict[str, object]) -> object:
    """The default a user gets without the flag: argparse's, or for a flag that sets a config key
    (argparse.SUPPRESS) the config's, as its config-keys section lists it. None: nothing to state."""
    if action.nargs == 0 or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None  # switches, --help, --version
    default = action.default
    if default is argparse.SUPPRESS:
        default = config_defaults.get(action.dest)
    if (
        default is None
        or default is dataclasses.MISSING
        or isinstance(default, bool)
        or default in ((), [], "")
    ):
        return None
    return default


def test_every_commands_help_states_the_defaults_of_its_flags(parsers):
    checked = 0
    for path, parser in parsers:
        spec = parser.get_default("config_spec")
        flagged: dict[str, object] = {}
        if spec is not None:
            keys = {d.key: d.default for d in describe(spec.cls, spec.defaults)}
            flagged = {f.dest: keys.get(f.key) for f in spec.flags}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            default = stated_default(action, flagged)
            if default is None:
                continue
            text = action_help(parser, action)
            shown = {f"(default: {default})", f"(default: {show_value(default)})"}
            # The note argparse-style, or the help's own words about its default ("5GB (default)").
            assert any(s in text for s in shown) or "default" in text.lower(), (path, text)
            checked += 1
        if spec is not None:  # and the config-keys section lists every key's default
            assert " = " in parser.format_help(), path
    assert checked > 100  # every command was walked


def test_no_help_prints_a_doubled_percent_sign(parsers):
    for path, parser in parsers:
        assert "%%" not in parser.format_help(), path


def test_version_is_the_packages():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert jaxpi.__version__ == version
    out = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "--version"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout == f"jaxpi {version}\n"


def test_demo_help_describes_every_stage_the_demo_runs():
    """The stages are read from jaxpi/demo.py's own progress lines ("[5/5] grpo ...")."""
    stages = re.findall(r"\[(\d)/(\d)\] (\w+)", (ROOT / "jaxpi" / "demo.py").read_text())
    assert [int(k) for k, _, _ in stages] == list(range(1, int(stages[0][1]) + 1))
    text = subcommands(build_parser("demo"))["demo"].format_help()
    for k, _, name in stages:
        assert re.search(rf"^\s+{k}\. {name} ", text, re.MULTILINE), (name, text)
    assert "GRPO" in help_for("demo")  # `jaxpi --help`'s line names it too


def test_every_flag_the_readme_lists_is_one_the_command_takes(parsers):
    """README's command-line block: each flag on a `jaxpi CMD [SUB|SUB ...]` line is taken by the
    command (by each SUB the line names)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    by_path = dict(parsers)
    lines = [line for line in block.splitlines() if line.startswith("jaxpi ")]
    assert len(lines) > 15
    for line in lines:
        words = line.split()
        command = (words[1],)
        subs = words[2].split("|") if len(words) > 2 else []
        if subs and all((*command, s) in by_path for s in subs):
            targets = [(*command, s) for s in subs]
        else:
            targets = [command]
        for target in targets:
            taken = by_path[target]._option_string_actions
            missing = sorted(f for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", line) if f not in taken)
            assert not missing, (" ".join(target), missing, line)


def test_vllm_tiny_checkpoint_json(tmp_path, capsys):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{}")  # already written: the command reuses it
    assert main(["vllm", "tiny-checkpoint", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"output": str(out), "files": ["config.json"]}
