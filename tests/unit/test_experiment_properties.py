"""Property tests of the Experiment validator: accept and round-trip (JSON, TOML) unchanged, or name the field."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossamer import ConfigError, Experiment
from gossamer.compression import parse_codec
from gossamer.core.experiment import MODES, OPTIMIZERS, OUTER_STEPS, PARALLELISMS, TOPOLOGIES
from gossamer.core.modes import mode_of
from gossamer.paramserver.optimizer import OptimizerConfig
from gossamer.paramserver.shard import ShardConfig

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BASE = {"name": "x", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}
FIELDS = {f.name: f for f in dataclasses.fields(Experiment)}

# -- strategies --------------------------------------------------------------------------

any_text = st.text(st.characters(codec=None), max_size=12)  # includes lone surrogates
edge_ints = st.sampled_from([0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30, 10**400])
edge_floats = st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-300, 1e308, math.nan, math.inf, -math.inf])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 40), edge_ints, st.floats(), edge_floats, any_text,
    st.binary(max_size=4),
)
garbage = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(any_text, st.integers(0, 3)), inner, max_size=3),
        st.tuples(inner),
    ),
    max_leaves=6,
)
digits = st.one_of(st.integers(0, 200).map(str), st.sampled_from(["", "0000000001", "1" * 12, "٣", "²", "-1", "1.5"]))
codec_specs = st.one_of(
    st.sampled_from(["none", "fp16", "bf16", "int8", "sign", "adaptive", "auto", "NONE", "zip", "topk", "qsgd"]),
    st.builds(lambda a: f"qsgd:{a}", digits),
    st.builds(lambda a: f"powersgd:{a}", digits),
    st.builds(lambda a: f"topk:{a}", st.one_of(
        st.floats(-1, 2).map(repr), st.sampled_from(["0.01", ".5", "1", "1.0", "1e-3", "0e-1", "5e-0", "nan", "inf",
                                                    "1_0", "0x1", " 0.5", "0.5 "]))),
    any_text,
).flatmap(lambda s: st.sampled_from([s, s + "\n", " " + s, s.upper()]))
callables = st.one_of(
    st.sampled_from([BASE["model"], BASE["dataset"], "a:b", "a.b.c:d", "no_colon", ":x", "x:", "a:b:c", "1a:b",
                     "a-b:c", "é.m:f", "a:b\n", "\na:b", "a..b:c"]),
    any_text,
)

# Values a user (TOML), a client (JSON) or a bug could put in each field: plausible ones
# around the valid range, and garbage of every type.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "name": st.one_of(st.just("run"), any_text),
    "model": callables,
    "dataset": callables,
    "mode": st.sampled_from([*MODES, "turbo", "", "SYNC"]),
    "compression": codec_specs,
    "pull_compression": codec_specs,
    "compression_overrides": st.dictionaries(st.one_of(st.just("*.bias"), any_text), codec_specs, max_size=3),
    "optimizer": st.sampled_from([*OPTIMIZERS, "auto", "lbfgs"]),
    "outer_step": st.sampled_from([*OUTER_STEPS, "sometimes"]),
    "topology": st.sampled_from([*TOPOLOGIES, "star"]),
    "parallelism": st.sampled_from([*PARALLELISMS, "tensor"]),
    "model_args": st.dictionaries(any_text, garbage, max_size=3),
    "dataset_args": st.dictionaries(any_text, garbage, max_size=3),
    "checkpoint_dir": st.one_of(st.just("/tmp/ck"), any_text),
    "profile_nodes": st.lists(any_text, max_size=3),
}
for _name, _f in FIELDS.items():
    if _name in PLAUSIBLE:
        continue
    if _f.type == "bool":
        PLAUSIBLE[_name] = st.booleans()
    elif _f.type == "str":
        PLAUSIBLE[_name] = st.one_of(st.just(_f.default), any_text)
    elif "float" in str(_f.type):
        PLAUSIBLE[_name] = st.one_of(st.floats(-1, 12), edge_floats, st.integers(-1, 3))
    else:
        PLAUSIBLE[_name] = st.one_of(st.integers(-2, 40), edge_ints)


@st.composite
def experiment_dicts(draw: st.DrawFn) -> dict[Any, Any]:
    data: dict[Any, Any] = dict(BASE)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        data[name] = draw(st.one_of(PLAUSIBLE[name], PLAUSIBLE[name], garbage))
    if draw(st.integers(0, 9)) == 0:
        data[draw(st.one_of(any_text, st.integers(), st.none()))] = draw(scalars)
    if draw(st.integers(0, 19)) == 0:
        del data[draw(st.sampled_from(sorted(BASE)))]
    return data


# -- the property ------------------------------------------------------------------------


def _toml_clean(d: dict[str, Any]) -> bool:
    """TOML has no null: values holding None are written by leaving the key out (top level only)."""

    def has_none(v: Any) -> bool:
        if v is None:
            return True
        if isinstance(v, list):
            return any(has_none(x) for x in v)
        if isinstance(v, dict):
            return any(has_none(x) for x in v.values())
        return False

    return not any(has_none(v) for v in d.values() if v is not None)


def check_validation(data: dict[Any, Any], toml_dir: Path | None = None) -> Experiment | None:
    """Validate `data`: a ConfigError naming the field, or an experiment that round-trips.

    Any other exception type propagates and fails the calling test.
    """
    try:
        exp = Experiment.from_dict(data)
    except ConfigError as e:
        assert e.field in FIELDS or e.field == "experiment" or e.field in {str(k) for k in data}, e.field
        assert str(e).startswith(f"{e.field}: "), str(e)
        return None
    assert Experiment.from_json(exp.to_json()) == exp
    d = exp.to_dict()
    if toml_dir is not None and _toml_clean(d):
        path = toml_dir / "exp.toml"
        path.write_text(tomli_w.dumps({k: v for k, v in d.items() if v is not None}), encoding="utf-8")
        assert Experiment.from_toml(path) == exp
    # What the validator accepts, the codec parser the workers and shards use accepts too.
    specs = [exp.compression, exp.pull_compression, *exp.compression_overrides.values()]
    for spec in specs:
        if spec != "adaptive":
            parse_codec(spec)
    return exp


@pytest.fixture(scope="module")
def toml_dir() -> Any:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("GOSSAMER_EXP_")}
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)
    os.environ.update(saved)


@SETTINGS
@given(data=experiment_dicts())
def test_validator_accepts_and_round_trips_or_names_the_field(toml_dir: Path, data: dict[Any, Any]) -> None:
    check_validation(data, toml_dir)


@SETTINGS
@given(name=st.sampled_from(sorted(FIELDS)), value=st.one_of(garbage, edge_ints, edge_floats))
def test_garbage_in_any_single_field_is_refused_or_round_trips(toml_dir: Path, name: str, value: Any) -> None:
    check_validation({**BASE, name: value}, toml_dir)


@SETTINGS
@given(spec=codec_specs)
def test_validator_and_codec_parser_agree_on_compression_specs(spec: str) -> None:
    try:
        Experiment(**BASE, compression=spec)
    except ConfigError as e:
        assert e.field == "compression"
        return
    if spec not in ("adaptive", "auto"):
        parse_codec(spec)


@SETTINGS
@given(text=st.one_of(
    any_text,
    st.builds(lambda n: "[" * n, st.integers(1, 5000)),
    st.builds(lambda n: '{"name": ' + "1" * n + "}", st.integers(1, 6000)),
    st.builds(lambda s: '{"name": "x", "model": "a:b", "dataset": "a:b", "seed": ' + s + "}",
              st.sampled_from(["NaN", "Infinity", "-1", "1e400", "18446744073709551616", "true", "[]", '"0"'])),
))
def test_from_json_of_any_text_is_an_experiment_or_a_config_error(text: str) -> None:
    try:
        exp = Experiment.from_json(text)
    except ConfigError as e:
        assert str(e).startswith(f"{e.field}: ")
    else:
        assert Experiment.from_json(exp.to_json()) == exp


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                     st.sampled_from([b"experiment = 5", b"experiment = [1]", b"a = " + b"[" * 3000,
                                      b"name = \"x\"\xff", b"[experiment]\nname = 1"])))
def test_from_toml_of_any_bytes_is_an_experiment_or_a_config_error(toml_dir: Path, raw: bytes) -> None:
    path = toml_dir / "any.toml"
    path.write_bytes(raw)
    try:
        Experiment.from_toml(path)
    except ConfigError as e:
        assert str(e).startswith(f"{e.field}: ")


# -- regressions: each a value that escaped validation as another exception type ---------------


def _short_id(v: Any) -> str:
    if isinstance(v, int) and abs(v) > 10**20:
        return f"{'-' if v < 0 else ''}int{v.bit_length()}bits"
    return repr(v)[:24]


def _nested(depth: int) -> list[Any]:
    out: list[Any] = [1]
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 10**400),  # OverflowError in math.isfinite
        ("momentum", 10**30),
        ("weight_decay", 10**400),
        ("adaptive_target_share", 10**5000),  # repr() of it raised ValueError
        ("total_steps", 2**64),  # accepted, then no TOML/SQLite/msgpack could carry it
        ("seed", -(2**63) - 1),
        ("nesterov", "yes"),  # accepted as truthy
        ("overlap", 1),
        ("lr_staleness_scaling", None),
        ("name", "\ud800"),  # accepted; protobuf then failed to encode every List reply
        ("checkpoint_dir", "/tmp/\udcff"),
        ("model", "gossamer.examples.digits:mlp\n"),  # `$` matches before a final newline
        ("compression", "none\n"),
        ("compression", "qsgd:0000000001"),  # parse_codec refuses more than 9 digits
        ("compression", "powersgd:99999999999"),
        ("compression", "qsgd:٣"),  # \d matched non-ASCII digits
        ("model_args", {"a": b"x"}),  # to_json raised TypeError
        ("model_args", {1: 2}),  # came back from JSON as {"1": 2}
        ("model_args", {"a": math.nan}),  # came back unequal
        ("dataset_args", {"a": (1, 2)}),  # came back as a list
        ("model_args", {"deep": _nested(40)}),
    ],
    ids=_short_id,
)
def test_value_that_escaped_validation_is_now_a_config_error_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        Experiment.from_dict({**BASE, "momentum": 0.9, field: value})
    assert err.value.field == field


def test_unknown_non_string_keys_are_named_not_a_type_error() -> None:
    with pytest.raises(ConfigError) as err:
        Experiment.from_dict({**BASE, 1: 2, "zzz": 3})
    assert err.value.field == "1"


@pytest.mark.parametrize("text", ["[" * 100_000, "1" * 5000, '{"name": ' + "9" * 5000 + "}"])
def test_json_too_deep_or_with_too_many_digits_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        Experiment.from_json(text)
    assert err.value.field == "experiment"


def test_toml_file_that_is_no_table_binary_or_a_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "five.toml").write_text("experiment = 5\n")
    with pytest.raises(ConfigError) as err:
        Experiment.from_toml(tmp_path / "five.toml")
    assert err.value.field == "experiment"
    (tmp_path / "bin.toml").write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        Experiment.from_toml(tmp_path / "bin.toml")
    with pytest.raises(ConfigError, match="cannot be read"):
        Experiment.from_toml(tmp_path)


def test_env_override_with_too_many_digits_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "e.toml"
    f.write_text('name = "t"\nmodel = "a:b"\ndataset = "a:b"\n')
    monkeypatch.setenv("GOSSAMER_EXP_SEED", "1" * 5000)
    with pytest.raises(ConfigError) as err:
        Experiment.from_toml(f)
    assert err.value.field == "seed"


@SETTINGS
@given(spec=st.one_of(codec_specs, garbage))
def test_codec_parser_raises_only_config_errors(spec: Any) -> None:
    try:
        parse_codec(spec)
    except ConfigError as e:
        assert e.field == "compression"


@pytest.mark.parametrize("spec", ["qsgd:²", "powersgd:¹"])
def test_codec_parser_refuses_digits_int_cannot_read(spec: str) -> None:
    """Regression: str.isdigit() holds for superscripts, and int() then raised ValueError."""
    with pytest.raises(ConfigError, match="positive integer"):
        parse_codec(spec)


# -- what the validator accepts, every role accepts ---------------------------------------------

# Mostly valid values, so that most drawn experiments are accepted and reach the roles' checks.
_ROLE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "mode": st.sampled_from(MODES),
    "outer_step": st.sampled_from(OUTER_STEPS),
    "optimizer": st.sampled_from([*OPTIMIZERS, "auto"]),
    "lr": st.sampled_from([1e-4, 0.05, 1.0, 3.0]),
    "momentum": st.sampled_from([0.0, 0.5, 0.9]),
    "nesterov": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 0.01, 2.0]),
    "outer_lr": st.sampled_from([0.1, 0.7, 1.5]),
    "outer_momentum": st.sampled_from([0.0, 0.6, 0.9]),
    "staleness": st.one_of(st.none(), st.integers(0, 8)),
    "total_steps": st.integers(1, 100),
    "inner_steps": st.integers(1, 30),
    "lr_schedule": st.sampled_from(["constant", "linear", "cosine"]),
    "warmup_steps": st.integers(0, 10),
    "checkpoint_every": st.integers(0, 50),
    "lr_scaling": st.sampled_from(["none", "linear"]),
    "num_ps_shards": st.integers(0, 4),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.fixed_dictionaries({}, optional=_ROLE_VALUES))
def test_an_accepted_experiment_builds_every_roles_config(data: dict[str, Any]) -> None:
    try:
        exp = Experiment.from_dict({**BASE, **data})
    except ConfigError:
        return
    # The workers' inner optimizer (gossip, diloco) and the shards' (sync, async) ...
    OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum, nesterov=exp.nesterov,
                    weight_decay=exp.weight_decay)
    # ... and each shard's settings, where the mode has shards.
    if mode_of(exp).servers:
        ShardConfig.for_experiment(exp, "e1", 0)
