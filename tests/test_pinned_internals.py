"""What sloserve relies on inside other libraries, checked by name, so that an upgrade that moves
any of it fails here, loudly, instead of somewhere in a server under load:

- the libraries whose internals the code uses are pinned in pyproject.toml with an upper bound,
  and what is installed is inside the pin;
- uvicorn's H11Protocol (server/connections.py subclasses it): its constructor, and on a live
  connection the attributes the subclass reads (`connections`, `cycle.response_complete`,
  `conn.their_state`, `transport`, `loop`, `client`); uvicorn.Server's exit flags;
- FastAPI's body-parse message (server/errors.py matches it to answer `invalid_json`);
- tokenizers' serialized decoder state (engine/tokenizer.py reads it);
- gguf's reader and quants functions (engine/weights.py), on the embedded model's file.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import socket
import sys
import threading
import time
from pathlib import Path

import h11
import numpy as np
import pytest
import uvicorn
from packaging.requirements import Requirement

from server_helpers import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
# distribution -> where the code reaches inside it
REACHED_INTO = {
    "uvicorn": "server/connections.py: LimitedH11Protocol, DrainingServer",
    "h11": "server/connections.py: the connection state LimitedH11Protocol reads",
    "fastapi": "server/errors.py: the body-parse message; GuardedRoute",
    "pydantic": "server/protocol.py: strict models and their error locations",
    "tokenizers": "engine/tokenizer.py: a decoder's serialized state",
    "gguf": "engine/gguf_file.py and engine/weights.py: the tensor types, their sizes, gguf.quants",
    "schemathesis": "tests/fuzz_helpers.py: its checks and failure types",
    "promql-parser": "tests/test_deploy_board.py: its AST node types",
}


def declared() -> dict[str, Requirement]:
    if sys.version_info < (3, 11):
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    out: dict[str, Requirement] = {}
    for req in reqs:
        if req.marker is None or req.marker.evaluate():
            out.setdefault(req.name.lower(), req)
    return out


@pytest.mark.parametrize("name", sorted(REACHED_INTO))
def test_what_the_code_reaches_into_is_pinned_and_installed_as_pinned(name):
    req = declared().get(name)
    assert req is not None, f"{name} is not declared in pyproject.toml ({REACHED_INTO[name]})"
    bounded = [s for s in req.specifier if s.operator in ("<", "<=", "==", "~=", "===")]
    assert bounded, f"{req}: needs an upper bound or an exact pin ({REACHED_INTO[name]})"
    installed = importlib.metadata.version(name)
    assert req.specifier.contains(installed, prereleases=True), \
        f"{name} {installed} is installed but pyproject.toml pins {req.specifier} ({REACHED_INTO[name]})"


# ---- uvicorn and h11 -----------------------------------------------------------------------
def test_uvicorn_builds_its_protocol_as_limited_h11_protocol_expects():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    params = list(inspect.signature(H11Protocol.__init__).parameters)
    assert params == ["self", "config", "server_state", "app_state", "_loop"], \
        f"uvicorn's H11Protocol.__init__ is now {params}: update LimitedH11Protocol.__init__"
    server = uvicorn.Server(uvicorn.Config(lambda *a: None))
    for name in ("started", "should_exit", "force_exit", "_captured_signals", "server_state"):
        assert hasattr(server, name), f"uvicorn.Server has no {name!r}: update DrainingServer"
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]


async def _hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_live_h11_connection_has_what_limited_h11_protocol_reads():
    """A real uvicorn server with sloserve's config on 127.0.0.1: one connection mid-way through
    a request head, then after a complete request, read through the server's own state."""
    from sloserve.server.connections import ConnectionLimits, LimitedH11Protocol, uvicorn_config

    port = free_port()
    server = uvicorn.Server(uvicorn_config(_hello, host="127.0.0.1", port=port, limits=ConnectionLimits(),
                                           loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    sock = None
    try:
        wait_for(lambda: server.started, 30, what="uvicorn started")
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head is not complete yet
        protocols = wait_for(lambda: list(server.server_state.connections), 10, what="the connection")
        (proto,) = protocols
        assert isinstance(proto, LimitedH11Protocol)
        assert proto.connections is server.server_state.connections
        for name in ("cycle", "conn", "transport", "loop", "client"):
            assert hasattr(proto, name), f"uvicorn's H11Protocol has no {name!r}: update LimitedH11Protocol"
        assert proto.cycle is None and proto.conn.their_state is h11.IDLE  # between requests
        sock.sendall(b"\r\n")
        reply = b""
        while not reply.endswith(b"ok"):
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        time.sleep(0.05)
        assert proto.cycle is not None and proto.cycle.response_complete is True, \
            "uvicorn's RequestResponseCycle has no response_complete: update LimitedH11Protocol._between_requests"
        assert proto.conn.their_state in (h11.DONE, h11.IDLE)
    finally:
        if sock is not None:
            sock.close()
        server.should_exit = True
        thread.join(15)


# ---- FastAPI, tokenizers, gguf -------------------------------------------------------------
def test_fastapi_still_says_what_errors_py_matches():
    import fastapi.routing

    from sloserve.server import errors

    assert errors._FASTAPI_BODY_PARSE_ERROR in inspect.getsource(fastapi.routing), \
        "FastAPI changed its body-parse error message: update server/errors.py"


def test_a_byte_level_decoder_is_recognised_from_its_serialized_state():
    import tokenizers
    from tokenizers import decoders, models

    from sloserve.engine.tokenizer import _uses_byte_level

    byte_level = tokenizers.Tokenizer(models.BPE())
    byte_level.decoder = decoders.ByteLevel()
    other = tokenizers.Tokenizer(models.BPE())
    other.decoder = decoders.Metaspace()
    assert _uses_byte_level(byte_level) and not _uses_byte_level(other)


def test_our_gguf_reader_reads_what_gguf_py_reads():
    """engine/gguf_file.py parses the header itself and leans on gguf-py for the tensor types,
    their block sizes and dequantization: on the embedded model it gives every metadata value as
    GGUFReader's `contents()` and every tensor as GGUFReader's view of the same bytes."""
    import gguf

    from sloserve.engine.gguf_file import read_gguf
    from sloserve.engine.weights import embedded_model_path

    path = embedded_model_path()
    ours, reader = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
    tensor = ours.tensors[0]
    shape = tuple(reversed(tensor.shape))
    assert int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, tensor.tensor_type))) == tensor.data.nbytes
    assert gguf.quants.dequantize(tensor.data, tensor.tensor_type).size == int(np.prod(shape))
