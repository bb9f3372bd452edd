"""The Experiment validator: good configs round-trip, bad ones raise ConfigError naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossamer import ConfigError, Experiment
from gossamer.compression import CODECS, CodecEntry
from gossamer.core.codec_table import codec_entry
from gossamer.core.modes import mode_of
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver.optimizer import OptimizerConfig
from gossamer.paramserver.shard import ShardConfig

BASE = {"name": "x", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}


def test_defaults_round_trip_through_json() -> None:
    exp = Experiment(**BASE, compression="topk:0.01", staleness=2)
    assert Experiment.from_json(exp.to_json()) == exp


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "turbo"),
        ("lr", -0.1),
        ("lr", math.nan),
        ("lr", 0),
        ("momentum", 1.0),
        ("batch_size", 0),
        ("batch_size", 2.5),
        ("staleness", -1),
        ("start_timeout_s", 0),
        ("node_wait_timeout_s", math.inf),
        ("node_wait_timeout_s", True),
        ("progress_timeout_s", "600"),
        ("progress_timeout_s", 31 * 86400),
        ("shard_timeout_s", 0),
        ("shard_timeout_s", math.nan),
        ("compression", "zip"),
        ("compression", "topk:abc"),
        ("optimizer", "lbfgs"),
        ("model", "no_colon"),
        ("topology", "star"),
        ("gossip_lag", -1),
        ("gossip_lag", True),
        ("gossip_lag", None),  # BASE is not gossip: the lag bound is gossip's alone
        ("parallelism", "tensor"),
        ("total_steps", 0),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        Experiment(**{**BASE, field: value})
    assert err.value.field == field


def test_max_workers_below_min_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_workers"):
        Experiment(**BASE, min_workers=4, max_workers=2)


def test_global_batch_only_in_sync() -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        Experiment(**BASE, mode="async", global_batch_size=64)
    assert Experiment(**BASE, mode="sync", global_batch_size=64).effective_global_batch(3) == 64
    assert Experiment(**BASE, mode="sync", batch_size=16).effective_global_batch(3) == 48


def test_unknown_key_in_dict_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        Experiment.from_dict({**BASE, "learning_rate": 0.1})
    assert err.value.field == "learning_rate"


def test_toml_file_with_cli_and_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "e.toml"
    f.write_text(
        'name = "t"\nmodel = "gossamer.examples.digits:mlp"\ndataset = "gossamer.examples.digits:data"\n'
        "lr = 0.1\nbatch_size = 8\nstaleness = 3\n"
    )
    monkeypatch.setenv("GOSSAMER_EXP_BATCH_SIZE", "16")
    monkeypatch.setenv("GOSSAMER_EXP_STALENESS", "5")
    exp = Experiment.from_toml(f, overrides={"staleness": 1})
    assert (exp.lr, exp.batch_size, exp.staleness) == (0.1, 16, 1)  # file < env < CLI


def test_bad_toml_file_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Experiment.from_toml(f)
    with pytest.raises(ConfigError, match="does not exist"):
        Experiment.from_toml(tmp_path / "missing.toml")


_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([
    "mode", "lr", "momentum", "batch_size", "staleness", "compression", "num_ps_shards", "min_workers",
    "max_workers", "total_steps", "global_batch_size", "seed", "eval_every", "optimizer", "nesterov",
]), _values, max_size=4))
def test_validator_accepts_or_names_a_field(fields: dict[str, object]) -> None:
    try:
        exp = Experiment.from_dict({**BASE, **fields})
    except ConfigError as e:
        assert e.field  # always names the field it refused
    except TypeError:
        pytest.fail("a bad value escaped validation as TypeError")
    else:
        assert Experiment.from_json(exp.to_json()) == exp


def test_mode_dependent_defaults_are_resolved_at_construction() -> None:
    dl = Experiment(**BASE, mode="diloco")
    assert (dl.optimizer, dl.compression) == ("adamw", "int8")
    plain = Experiment(**BASE, mode="gossip")
    assert (plain.optimizer, plain.compression) == ("sgd", "none")
    assert Experiment.from_json(dl.to_json()) == dl  # resolved values travel, not "auto"


@pytest.mark.parametrize("codec", ["topk:0.01", "sign", "powersgd:4", "adaptive"])
def test_gossip_refuses_codecs_that_do_not_carry_values(codec: str) -> None:
    with pytest.raises(ConfigError, match="gossip exchanges parameter values") as e:
        Experiment(**BASE, mode="gossip", compression=codec)
    assert e.value.field == "compression"
    with pytest.raises(ConfigError, match="gossip exchanges"):
        Experiment(**BASE, mode="diloco", outer_step="gossip", compression=codec)
    Experiment(**BASE, mode="diloco", outer_step="sync", compression="topk:0.01")  # servers: any codec


def test_outer_step_and_overlap_are_checked() -> None:
    with pytest.raises(ConfigError, match="outer step"):
        Experiment(**BASE, mode="diloco", outer_step="sometimes")
    Experiment(**BASE, mode="gossip", overlap=True)
    with pytest.raises(ConfigError) as e:
        Experiment(**BASE, mode="sync", overlap=True)
    assert e.value.field == "overlap"


def test_error_feedback_and_round_start_are_checked() -> None:
    assert Experiment(**BASE, mode="diloco").error_feedback == "auto"
    Experiment(**BASE, mode="diloco", error_feedback="off", round_start="shards")
    for kw in ({"error_feedback": "sometimes"}, {"error_feedback": True}, {"mode": "gossip", "error_feedback": "off"},
               {"round_start": "disk"}, {"mode": "sync", "round_start": "shards"},
               {"mode": "diloco", "outer_step": "async", "round_start": "shards"},
               {"mode": "diloco", "round_start": "shards", "pull_compression": "int8"}):
        with pytest.raises(ConfigError) as e:
            Experiment(**{**BASE, "mode": "diloco", **kw})  # type: ignore[arg-type]
        assert e.value.field == next(k for k in kw if k not in ("mode", "outer_step", "pull_compression")), kw


def test_every_example_file_is_a_valid_experiment() -> None:
    files = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert len(files) >= 4
    for f in files:
        Experiment.from_toml(f)


# --- codecs: the registry's grammar ---------------------------------------------------------


@pytest.mark.parametrize("spec", [s for e in CODECS for s in e.examples])
def test_every_registry_codec_is_accepted_where_it_applies(spec: str) -> None:
    Experiment(**BASE, mode="async", compression=spec, pull_compression=spec, compression_overrides={"*.bias": spec})
    if codec_entry(spec.partition(":")[0]).carries_values:
        Experiment(**BASE, mode="gossip", compression=spec)
    else:
        with pytest.raises(ConfigError, match="exchanges parameter values") as e:
            Experiment(**BASE, mode="gossip", compression=spec)
        assert e.value.field == "compression"


@pytest.mark.parametrize("field", ["compression", "pull_compression", "compression_overrides"])
@pytest.mark.parametrize("entry", [e for e in CODECS if e.arg is not None], ids=lambda e: e.name)
def test_a_codec_argument_outside_its_grammar_is_refused_naming_the_field(field: str, entry: CodecEntry) -> None:
    for spec in (f"{entry.name}:0", entry.name, f"{entry.name}:x"):
        value: object = {"*": spec} if field == "compression_overrides" else spec
        with pytest.raises(ConfigError) as e:
            Experiment(**{**BASE, field: value})
        assert e.value.field == field


# --- what the roles would refuse, refused at submit -----------------------------------------


def test_diloco_with_adamw_and_momentum_is_refused_at_submit_naming_momentum() -> None:
    for kw in ({"optimizer": "adamw"}, {}):  # "auto" is adamw in diloco
        with pytest.raises(ConfigError, match="only applies to optimizer='sgd'") as e:
            Experiment(**BASE, mode="diloco", momentum=0.9, **kw)
        assert e.value.field == "momentum"
    with pytest.raises(ConfigError) as e:
        Experiment(**BASE, mode="async", optimizer="adamw", momentum=0.9, nesterov=True)
    assert e.value.field == "nesterov"
    Experiment(**BASE, mode="diloco", optimizer="sgd", momentum=0.9, nesterov=True)


@pytest.mark.parametrize("mode", [("sync", "sync"), ("async", "sync"), ("gossip", "sync"), ("diloco", "sync"),
                                  ("diloco", "async"), ("diloco", "gossip")], ids="/".join)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True), (0.0, True)])
def test_experiment_refuses_exactly_what_the_roles_optimizer_config_refuses(
    mode: tuple[str, str], optimizer: str, momentum: float, nesterov: bool
) -> None:
    kw = {"optimizer": optimizer, "lr": 0.01, "momentum": momentum, "nesterov": nesterov, "weight_decay": 0.01}
    try:
        # What a shard (sync, async) or a worker's inner optimizer (gossip, diloco) builds.
        OptimizerConfig(name=optimizer, lr=0.01, momentum=momentum, nesterov=nesterov, weight_decay=0.01)
    except ConfigError as role:
        with pytest.raises(ConfigError) as e:
            Experiment(**BASE, mode=mode[0], outer_step=mode[1], **kw)
        assert e.value.field == role.field
    else:
        exp = Experiment(**BASE, mode=mode[0], outer_step=mode[1], **kw)
        if mode_of(exp).servers:
            ShardConfig.for_experiment(exp, "e1", 0)


@pytest.mark.parametrize("mode", [("gossip", "sync"), ("diloco", "gossip")], ids="/".join)
def test_serverless_modes_accept_zero_parameter_servers(mode: tuple[str, str]) -> None:
    exp = Experiment(**BASE, mode=mode[0], outer_step=mode[1], num_ps_shards=0)
    assert not mode_of(exp).servers
    assert Experiment.from_json(exp.to_json()) == exp
    assert exp.num_ps_shards == 0  # kept as the user wrote it; the workers' flat layout is one plan shard
    assert ShardPlan.for_experiment(torch.nn.Linear(3, 2), exp).num_shards == 1


@pytest.mark.parametrize("mode", [("sync", "sync"), ("async", "sync"), ("diloco", "sync"), ("diloco", "async")],
                         ids="/".join)
def test_modes_with_servers_need_at_least_one(mode: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match=">= 1") as e:
        Experiment(**BASE, mode=mode[0], outer_step=mode[1], num_ps_shards=0)
    assert e.value.field == "num_ps_shards"
    with pytest.raises(ConfigError) as e:
        Experiment(**BASE, mode="gossip", num_ps_shards=-1)
    assert e.value.field == "num_ps_shards"


def test_gossip_lag_is_gossips_and_none_turns_the_bound_off() -> None:
    assert Experiment(**{**BASE, "mode": "gossip"}).gossip_lag == 1
    exp = Experiment(**{**BASE, "mode": "gossip", "gossip_lag": None})
    assert exp.gossip_lag is None and Experiment.from_json(exp.to_json()) == exp
    assert Experiment(**{**BASE, "mode": "gossip", "gossip_lag": 4}).gossip_lag == 4
    with pytest.raises(ConfigError, match="only applies to mode gossip") as err:
        Experiment(**{**BASE, "mode": "diloco", "outer_step": "gossip", "gossip_lag": 3})
    assert err.value.field == "gossip_lag"
