"""The command line as a newcomer meets it: defaults in --help, the documented defaults and commands, aliases, suggestions."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossamer.coordinator.placement import nodes_needed
from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.modes import resolve
from gossamer.tools.cli_parser import build_parser, normalize_argv, parse_args
from tests._doc_blocks import ROOT, blocks, gossamer_argv

README = ROOT / "README.md"
CLI_PAGE = ROOT / "docs" / "cli.md"  # the defaults table
#: The pages whose every block is marked and checked.
DOCS = [README, *(ROOT / "docs" / name for name in ("quickstart.md", "cli.md", "experiments.md", "modes.md",
                                                   "compression.md", "observability.md", "performance.md"))]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults as a fresh shell has them: GOSSAMER_* of the test's own environment would change them."""
    for k in list(os.environ):
        if k.startswith("GOSSAMER_"):
            monkeypatch.delenv(k)


def _subparsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSAMER_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


# --- item 3: --help shows every default -----------------------------------------------------------
def test_every_option_has_help_and_every_set_default_is_shown_in_it() -> None:
    for path, p in _subparsers(build_parser()):
        helptext = "".join(p.format_help().split())  # wrapping may break a default at a hyphen
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"gossamer {' '.join(path)} {name}: no help text"
            d = action.default
            if d in (None, "", [], False) or action.nargs == 0 and d is False:
                continue  # unset: the help says what happens (e.g. "off unless given")
            shown = "on" if d is True else " ".join(map(str, d)) if isinstance(d, list) else str(d)
            assert "".join(f"(default: {shown})".split()) in helptext, f"gossamer {' '.join(path)} {name}: default {d!r} not in --help"


def test_the_cli_page_defaults_table_matches_the_parser() -> None:
    rows = re.findall(r"^\| `([a-z ]+)` \| `([a-z-]+)` \| `([^`]*)`", CLI_PAGE.read_text(), re.M)
    assert len(rows) >= 15, rows
    parsers = {" ".join(path): p for path, p in _subparsers(build_parser())}
    for command, flag, value in rows:
        p = parsers[command]
        (action,) = [a for a in p._actions if flag in a.option_strings or a.dest == flag]
        assert str(action.default) == value, f"docs/cli.md: `{command} {flag}` defaults to {value}, the parser to {action.default!r}"


def test_help_through_the_real_cli_shows_defaults() -> None:
    out = _cli("coordinator", "serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for expected in ("--port PORT port (0 picks a free one) (default: 7070)", "(default: 10.0)", "(default: 16.0)",
                     "(default: 200.0)"):
        assert expected in text, text
    out = _cli("worker", "join", "--help")
    text = " ".join(out.stdout.split())
    assert "(default: 30.0)" in text and "(default: 120.0)" in text and "--no-warm-roles" in text, text
    assert re.search(r"--warm-roles, --no-warm-roles .*\(default: on\)", text), text
    assert "--preload [MODULE ...]" in text, text


# --- item 5: the short spellings, and the contract's long ones ---------------------------------
def test_coordinator_and_worker_alone_mean_serve_and_join() -> None:
    assert normalize_argv(["coordinator", "--port", "0"]) == ["coordinator", "serve", "--port", "0"]
    assert normalize_argv(["coordinator"]) == ["coordinator", "serve"]
    assert normalize_argv(["worker", "10.0.0.1:7070"]) == ["worker", "join", "10.0.0.1:7070"]
    a = parse_args(["worker", "10.0.0.1:7070", "--spot"])
    assert (a.fn, a.coordinator, a.spot) == ("worker_join", "10.0.0.1:7070", True)
    assert parse_args(["coordinator", "--port", "0"]).fn == "coordinator_serve"
    # the contract's spellings are untouched
    assert normalize_argv(["coordinator", "serve", "--port", "1"]) == ["coordinator", "serve", "--port", "1"]
    assert parse_args(["worker", "join", "h:1"]).coordinator == "h:1"


def test_bare_coordinator_through_the_real_cli_is_serve(tmp_path: Path) -> None:
    out = _cli("coordinator", "--help")
    assert out.returncode == 0 and "usage: gossamer coordinator serve" in out.stdout, out.stdout + out.stderr
    out = _cli("worker", "--help")
    assert out.returncode == 0 and "usage: gossamer worker join" in out.stdout, out.stdout + out.stderr


# --- item 6: did you mean --------------------------------------------------------------------------
def test_a_mistyped_verb_or_flag_gets_a_suggestion() -> None:
    out = _cli("statsu")
    assert out.returncode == 2 and "did you mean 'status'?" in out.stderr, out.stderr
    out = _cli("local", "upp")
    assert out.returncode == 2 and "did you mean 'up'?" in out.stderr, out.stderr
    out = _cli("submit", "x.toml", "--wiat")
    assert out.returncode == 2 and "did you mean --wait (for --wiat)?" in out.stderr, out.stderr


def test_a_mistyped_experiment_field_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"totl_steps: unknown field; did you mean 'total_steps'\?"):
        Experiment.from_dict({"name": "x", "model": "m:f", "dataset": "m:d", "totl_steps": 5})
    with pytest.raises(ConfigError, match=r"^zzz: unknown field$"):
        Experiment.from_dict({"name": "x", "model": "m:f", "dataset": "m:d", "zzz": 5})
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "examples" / "digits.toml").read_text().replace("total_steps", "totl_steps"))
    out = _cli("submit", str(bad), "-c", "127.0.0.1:1")
    assert out.returncode == 2 and "did you mean 'total_steps'?" in out.stderr, out.stderr


# --- item 4: an address without a port ----------------------------------------------------------
def test_an_address_without_a_port_is_refused_at_once() -> None:
    out = _cli("status", "-c", "127.0.0.1")
    assert out.returncode == 2 and "missing :PORT?" in out.stderr and "127.0.0.1:7070" in out.stderr, out.stderr
    out = _cli("worker", "join", "10.0.0.1")
    assert out.returncode == 2 and "missing :PORT?" in out.stderr, out.stderr
    assert "left" not in out.stderr


# --- item 2: the README's blocks -------------------------------------------------------------------
def test_every_code_block_of_the_docs_says_how_it_is_run() -> None:
    modes = {b.mode for path in DOCS for b in blocks(path)}  # a block without a marker fails here
    assert modes <= {"shell", "file", "python", "parse", "make", "skip"}, modes
    for path in DOCS:
        for b in blocks(path):
            if b.mode == "skip":
                assert b.args.startswith("(") and len(b.args) > 5, f"{b.where}: a skipped block says why"


def test_every_gossamer_command_in_the_docs_parses() -> None:
    parser = build_parser()

    def fail(message: str) -> None:
        raise AssertionError(message)

    for _, p in _subparsers(parser):
        p.error = fail  # type: ignore[method-assign,assignment]
    checked = 0
    for path in DOCS:
        for b in blocks(path):
            if b.mode not in ("parse", "shell"):
                continue
            for line in b.commands():
                argv = gossamer_argv(line)
                assert argv is not None or b.mode == "parse" and not line.startswith("gossamer"), f"{b.where}: {line}"
                if argv is not None:
                    try:
                        parser.parse_args(normalize_argv(argv))
                    except AssertionError as e:
                        raise AssertionError(f"{b.where}: `{line}` is not accepted: {e}") from None
                    checked += 1
    assert checked >= 15, checked


def test_make_blocks_name_real_targets() -> None:
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    for b in blocks(README):
        if b.mode == "make":
            for line in b.commands():
                assert line.split()[0] == "make" and line.split()[1] in targets, f"{b.where}: {line}"


def test_the_readme_says_how_many_nodes_each_example_needs() -> None:
    rows = re.findall(r"^\| `(examples/[\w-]+\.toml)` \| (\d+) \| (\d+) \+ (\d+) \|", README.read_text(), re.M)
    assert {r[0] for r in rows} == {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.toml")}
    for file, total, shards, workers in rows:
        exp = Experiment.from_toml(ROOT / file)
        spec = exp.to_dict()
        need = nodes_needed(spec, resolve(spec["mode"], spec.get("outer_step", "sync")))
        assert need == (int(shards), int(workers)) and sum(need) == int(total), (file, need)


# --- item 7: local up/down refuse bad input before starting anything -------------------------------
def test_local_up_checks_its_counts_and_down_without_a_cluster_says_so(tmp_path: Path) -> None:
    out = _cli("local", "up", "--nodes", "2", "--spot", "3", "--dir", str(tmp_path))
    assert out.returncode == 2 and "spot: must be between 0 and --nodes (2), got 3" in out.stderr, out.stderr
    assert not (tmp_path / "cluster.json").exists()
    out = _cli("local", "down", "--dir", str(tmp_path))
    assert out.returncode == 0 and f"no local cluster in {tmp_path}" in out.stdout, out.stdout
    out = _cli("status", "--local", "--local-dir", str(tmp_path))
    assert out.returncode == 3 and "start one with `gossamer local up`" in out.stderr, out.stderr  # no coordinator to reach


def test_the_quickstart_installs_as_the_makefile_does() -> None:
    """Its install block is not run (network); it must not drift from the install CI runs."""
    (install,) = [b for b in blocks(ROOT / "docs" / "quickstart.md") if b.mode == "skip"]
    makefile = (ROOT / "Makefile").read_text()
    pins = re.findall(r"pip install -q (torch==[\d.]+)", makefile)
    assert pins and all(p in install.text for p in pins), (pins, install.text)
    assert "pip install -e ." in install.text and re.search(r"pip install -q (torch==[\d.]+ )?-e '\.\[dev\]'", makefile)
