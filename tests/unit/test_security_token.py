"""The join token: the loader refuses bad files clearly; the interceptor refuses calls without it (or with the viewer token)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.core.errors import ConfigError
from gossamer.security.token import (
    TokenAuthInterceptor,
    bearer,
    check_token,
    derive_viewer_token,
    generate_token,
    load_token,
)

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-token-0123456789"


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_load_token_reads_one_line_and_strips_whitespace(tmp_path: Path) -> None:
    assert load_token(_write(tmp_path / "t", f"\n  {TOKEN}  \n\n")) == TOKEN


@pytest.mark.parametrize("text, why", [("", "empty"), ("  \n\n", "empty"), ("a" * 20 + "\n" + "b" * 20, "one line"),
                                       ("two words here", "without spaces"), ("tök" * 8, "ASCII")])
def test_load_token_refuses_bad_files_naming_the_flag(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as e:
        load_token(_write(tmp_path / "t", text))
    assert e.value.field == "token_file"


def test_load_token_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read token file"):
        load_token(tmp_path / "nope")


def test_load_token_warns_about_short_and_world_readable_tokens(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    assert load_token(_write(tmp_path / "t", "short", mode=0o644)) == "short"
    assert "readable by other users" in caplog.text and "only 5 characters" in caplog.text


def test_generated_tokens_are_long_and_distinct() -> None:
    tokens = {generate_token() for _ in range(50)}
    assert len(tokens) == 50 and min(map(len, tokens)) >= 40


def test_the_viewer_token_is_derived_the_same_on_every_coordinator_and_is_not_the_join_token() -> None:
    viewer = derive_viewer_token(TOKEN)
    assert viewer == derive_viewer_token(TOKEN)  # standbys holding the same join token derive the same one
    assert check_token(viewer) == viewer and len(viewer) >= 40  # travels as a Bearer header or a cookie
    assert viewer != TOKEN and TOKEN not in viewer
    assert len({derive_viewer_token(generate_token()) for _ in range(50)} | {viewer}) == 51


def test_the_coordinator_s_viewer_token_is_its_file_s_else_derived_else_none(tmp_path: Path) -> None:
    join = _write(tmp_path / "join", TOKEN)
    viewer = _write(tmp_path / "viewer", "a-viewer-token-0123456789\n")
    state = str(tmp_path / "state")
    assert CoordinatorConfig(state_dir=state).viewer_token() is None
    assert CoordinatorConfig(state_dir=state, token_file=str(join)).viewer_token() == derive_viewer_token(TOKEN)
    assert CoordinatorConfig(state_dir=state, token_file=str(join),
                             viewer_token_file=str(viewer)).viewer_token() == "a-viewer-token-0123456789"
    assert CoordinatorConfig(state_dir=state, viewer_token_file=str(viewer)).viewer_token() == "a-viewer-token-0123456789"


def test_a_viewer_token_file_holding_the_join_token_or_nothing_is_refused_naming_the_field(tmp_path: Path) -> None:
    join = _write(tmp_path / "join", TOKEN)
    with pytest.raises(ConfigError, match="viewer_token_file.*join token"):
        CoordinatorConfig(state_dir=str(tmp_path), token_file=str(join), viewer_token_file=str(join))
    with pytest.raises(ConfigError, match="viewer_token_file.*empty"):
        CoordinatorConfig(state_dir=str(tmp_path), viewer_token_file=str(_write(tmp_path / "empty", "\n")))


# --- the interceptor, on a real grpc.aio server ---------------------------------------------
def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"echo:" + request


async def _stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    for i in range(3):
        yield bytes([i])


class _Server:
    def __init__(self, token: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.interceptor = TokenAuthInterceptor(token)
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        self.server = grpc.aio.server(interceptors=[self.interceptor])
        handlers = {"Echo": grpc.unary_unary_rpc_method_handler(_echo),
                    "Stream": grpc.unary_stream_rpc_method_handler(_stream)}
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", handlers)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server(TOKEN)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def channel(server: _Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def test_interceptor_passes_the_right_token(channel: grpc.Channel) -> None:
    echo = channel.unary_unary("/test.Echo/Echo")
    assert echo(b"hi", metadata=[bearer(TOKEN)], timeout=5) == b"echo:hi"
    stream = channel.unary_stream("/test.Echo/Stream")
    assert list(stream(b"", metadata=[bearer(TOKEN)], timeout=5)) == [b"\x00", b"\x01", b"\x02"]


@pytest.mark.parametrize("metadata", [None, [bearer("wrong-token-0123456789")], [bearer(TOKEN[:-1])],
                                      [("authorization", f"Basic {TOKEN}")], [("authorization", TOKEN)],
                                      [bearer(derive_viewer_token(TOKEN))]])
def test_interceptor_refuses_missing_or_wrong_token(server: _Server, channel: grpc.Channel,
                                                    metadata: list[tuple[str, str]] | None) -> None:
    for method, kind in (("/test.Echo/Echo", "unary"), ("/test.Echo/Stream", "stream")):
        call = channel.unary_unary(method) if kind == "unary" else channel.unary_stream(method)
        with pytest.raises(grpc.RpcError) as e:
            result = call(b"x", metadata=metadata, timeout=5)
            if kind == "stream":
                list(result)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details() == "missing or wrong token"
    assert server.interceptor.refused == 2


def test_health_service_stays_open_without_a_token(channel: grpc.Channel) -> None:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_interceptor_refuses_an_empty_token() -> None:
    with pytest.raises(ConfigError, match="empty"):
        TokenAuthInterceptor("")
