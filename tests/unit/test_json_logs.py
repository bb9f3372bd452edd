"""`--log-format json`: one parseable object per line with ts, level, logger, msg and the process context."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from gossamer.core import logs
from gossamer.core.errors import ConfigError


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, context = list(root.handlers), root.level, dict(logs._context)
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logs._context.clear()
    logs._context.update(context)


def test_each_record_is_one_json_line_with_context_and_extras(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("DEBUG", "json", stream=out, role="w0.0", node="spot-1", experiment="exp-abc")
    log = logging.getLogger("gossamer.worker.trainer")
    log.info("step %d of %s", 3, "exp-abc", extra={"step": 3, "loss": 0.5, "shape": (2, 3)})
    log.warning('quotes " and\nnewlines')
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    first, second, third = (json.loads(line) for line in lines)
    assert first["msg"] == "step 3 of exp-abc" and first["level"] == "INFO"
    assert first["logger"] == "gossamer.worker.trainer"
    assert (first["node"], first["experiment"], first["role"]) == ("spot-1", "exp-abc", "w0.0")
    assert (first["step"], first["loss"], first["shape"]) == (3, 0.5, "(2, 3)")
    assert first["ts"].endswith("Z") and first["ts"][10] == "T"
    assert "args" not in first and "levelno" not in first  # only the fields that say something
    assert second["msg"] == 'quotes " and\nnewlines' and second["level"] == "WARNING"
    assert third["level"] == "ERROR" and "RuntimeError: boom" in third["exc"]


def test_context_added_later_reaches_later_records(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("INFO", "json", stream=out, role="agent")
    logging.getLogger("x").info("before join")
    logs.set_context(node="n1")
    logging.getLogger("x").info("after join")
    before, after = (json.loads(line) for line in out.getvalue().splitlines())
    assert "node" not in before and after["node"] == "n1" and after["role"] == "agent"


def test_text_format_keeps_the_role_tag(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("INFO", "text", stream=out, role="ps1")
    logging.getLogger("gossamer.paramserver").info("serving")
    assert out.getvalue().rstrip().endswith("INFO [ps1] gossamer.paramserver: serving")


def test_unknown_format_or_level_is_a_config_error(restore_logging: None) -> None:
    with pytest.raises(ConfigError, match="log_format"):
        logs.configure("INFO", "xml")
    with pytest.raises(ConfigError, match="log_level"):
        logs.configure("LOUD", "json")
