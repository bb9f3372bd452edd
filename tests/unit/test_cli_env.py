"""Every flag of every verb from its GOSSAMER_* variable, through the real parser: set it, parse, see the value; the flag still wins."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import pytest

from gossamer.tools.cli_parser import build_parser, env_var, parse_args

#: Options without a variable of their own, and why (docs/cli.md, "Environment variables").
NO_VARIABLE = {
    ("submit", "--set"): "GOSSAMER_EXP_<FIELD>=VALUE sets an experiment field from the environment (--set beats it)",
    ("worker join", "--coordinator"): "the positional HOST:PORT's other spelling: GOSSAMER_COORDINATOR fills that one",
}
#: Variables not named after their flag: the same flag name means something else in another verb.
RENAMED = {
    ("local up", "--spot"): "GOSSAMER_LOCAL_SPOT",  # a count here; `worker join --spot` is a switch
    ("security init", "--address"): "GOSSAMER_SECURITY_ADDRESS",  # `worker join --address` is the node's own
    ("local up", "--dir"): "GOSSAMER_LOCAL_DIR",  # the same directory as the client verbs' --local-dir
    ("local down", "--dir"): "GOSSAMER_LOCAL_DIR",
    ("local status", "--dir"): "GOSSAMER_LOCAL_DIR",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("GOSSAMER_"):
            monkeypatch.delenv(k)


def _verbs(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Each verb's own parser ("coordinator serve", "status", ...), by its command words."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and path:
        yield " ".join(path), p
    for action in subs:
        for name, sub in action.choices.items():
            yield from _verbs(sub, (*path, name))


def _options(p: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for a in p._actions:
        if not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            yield a


def _name(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), action.dest)


def _argv(verb: str, p: argparse.ArgumentParser, but: argparse.Action) -> list[str]:
    """The command words and a value for each required positional and option other than `but`."""
    required = [w for a in p._actions if a.required and a is not but and a.option_strings for w in (_name(a), "x")]
    return [*verb.split(), *required, *("x" for a in p._actions if not a.option_strings and a.nargs is None)]


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _is_list(action: argparse.Action) -> bool:
    return action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction)


def _env_and_cli(action: argparse.Action) -> tuple[str, Any, list[str], Any]:
    """(variable's text, the value it gives, flag words on the command line, the value they give), each
    unlike the default."""
    d, flag = action.default, _name(action)
    if _is_switch(action):
        if isinstance(action, argparse.BooleanOptionalAction):
            return ("0", False, [flag], True) if d is not False else ("1", True, [f"--no-{flag[2:]}"], False)
        return "1", True, [], True  # a plain switch cannot be turned off on the command line
    if _is_list(action):
        return "a=1,b=2", ["a=1", "b=2"], [flag, "c=3"], ["c=3"]
    if action.choices:
        other = next(c for c in action.choices if c != d)
        return other, other, [flag, d], d
    if action.type in (int, float):
        return "7", action.type(7), [flag, "9"], action.type(9)
    cli = [flag, "y:2"] if action.option_strings else ["y:2"]
    return "from-env:1", "from-env:1", cli, "y:2"


def _walk() -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    for verb, p in _verbs(build_parser()):
        for action in _options(p):
            if action.option_strings or getattr(action, "env", None):
                yield verb, p, action


def test_every_flag_of_every_verb_has_its_variable_named_after_it_and_shown_in_help() -> None:
    seen = set()
    for verb, p, action in _walk():
        key = (verb, _name(action))
        if key in NO_VARIABLE:
            assert not getattr(action, "env", None), key
            seen.add(key)
            continue
        var = getattr(action, "env", None)
        assert var == RENAMED.get(key, env_var(action.option_strings, action.dest)), (key, var)
        assert var in "".join(p.format_help().split()), f"gossamer {verb} --help does not name {var}"
    assert seen == set(NO_VARIABLE)


def test_a_variable_shared_by_several_verbs_means_one_kind_of_value() -> None:
    kinds: dict[str, set[tuple[Any, ...]]] = {}
    for _, _, action in _walk():
        if getattr(action, "env", None):
            kind = (_is_switch(action), _is_list(action), getattr(action.type, "__name__", None), str(action.choices))
            kinds.setdefault(action.env, set()).add(kind)  # type: ignore[attr-defined]
    assert {var: k for var, k in kinds.items() if len(k) > 1} == {}


def test_every_flag_takes_its_variable_and_the_flag_beats_it(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = 0
    for verb, p, action in _walk():
        var = getattr(action, "env", None)
        if not var:
            continue
        raw, want, cli, cli_want = _env_and_cli(action)
        assert want != action.default, (verb, var)
        monkeypatch.setenv(var, raw)
        got = getattr(parse_args(_argv(verb, p, action)), action.dest)
        assert got == want, f"gossamer {verb} with {var}={raw}: {_name(action)} is {got!r}, not {want!r}"
        if cli:  # a flag beats its variable
            argv = [*verb.split(), *cli, *_argv(verb, p, action)[len(verb.split()):]]
            got = getattr(parse_args(argv), action.dest)
            assert got == cli_want, f"gossamer {' '.join(argv)} with {var}={raw}: {got!r}, not {cli_want!r}"
        monkeypatch.delenv(var)
        checked += 1
    assert checked >= 90, checked


def test_the_variables_the_issue_named_reach_their_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {"GOSSAMER_CONNECT_TIMEOUT": "1.5", "GOSSAMER_LABELS": "zone=a,gpu=h100",
                       "GOSSAMER_NODES": "2", "GOSSAMER_READY_FILE": "/tmp/port", "GOSSAMER_INTERVAL": "0.5",
                       "GOSSAMER_NO_IMPORT_CHECK": "yes", "GOSSAMER_WORKERS": "4", "GOSSAMER_KEEP": "true"}.items():
        monkeypatch.setenv(var, value)
    assert parse_args(["status"]).connect_timeout == 1.5
    assert parse_args(["worker", "join"]).labels == ["zone=a", "gpu=h100"]
    assert parse_args(["local", "up"]).nodes == 2
    serve = parse_args(["coordinator"])
    assert serve.ready_file == "/tmp/port" and serve.no_import_check is True
    assert parse_args(["watch", "x"]).interval == 0.5
    demo = parse_args(["demo"])
    assert demo.workers == 4 and demo.keep is True


def test_a_bad_value_in_a_variable_is_a_usage_error_naming_it_for_its_verb_only(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GOSSAMER_PORT", "seventy")
    monkeypatch.setenv("GOSSAMER_UDP_BEATS", "maybe")
    assert parse_args(["status"]).coordinator == "127.0.0.1:7070"  # another verb is not concerned
    with pytest.raises(SystemExit) as exit_:
        parse_args(["coordinator", "serve", "--udp-beats"])
    assert exit_.value.code == 2
    assert "argument --port: invalid int value: 'seventy' (from GOSSAMER_PORT)" in capsys.readouterr().err
    assert parse_args(["coordinator", "serve", "--port", "1", "--udp-beats"]).port == 1  # the flag wins
