"""Gossip accepts value codecs only; gradient-only codecs are refused with a reason."""

from __future__ import annotations

import pytest

from gossamer.compression import CODECS, parse_codec
from gossamer.core.codec_table import codec_entry
from gossamer.core.errors import ConfigError
from gossamer.training.gossip import parse_value_codec


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "qsgd:127"])
def test_value_codecs_are_accepted(spec: str) -> None:
    assert parse_value_codec(spec).spec == spec


@pytest.mark.parametrize("spec", ["topk:0.01", "sign", "powersgd:4", "adaptive"])
def test_sparse_sign_and_low_rank_codecs_are_refused_with_the_reason(spec: str) -> None:
    with pytest.raises(ConfigError, match="gossip exchanges parameters.*CHOCO") as e:
        parse_value_codec(spec)
    assert e.value.field == "compression"


def test_unknown_codec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown codec"):
        parse_value_codec("zip")


@pytest.mark.parametrize("spec", [s for e in CODECS for s in e.examples])
def test_gossip_takes_exactly_the_registry_codecs_that_carry_values(spec: str) -> None:
    if codec_entry(spec.partition(":")[0]).carries_values:
        assert parse_value_codec(spec).spec == parse_codec(spec).spec
    else:
        with pytest.raises(ConfigError, match="CHOCO"):
            parse_value_codec(spec)
