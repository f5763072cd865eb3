"""The transport an engine's address names.

The orchestrator reaches engine models over the engine server's own endpoints (not BLS: concurrent
decoupled BLS streams crash Triton 2.51's python backend; README, Known problems):
    http://host:port   Triton's HTTP `generate_stream`, a connection per request, every response read by one
                       thread (disagg.triton.engine_http)
    host:port          its gRPC endpoint, one shared stream per model (disagg.triton.engine_stream)
"""
from __future__ import annotations

from disagg.triton.engine_http import HttpEngineServer
from disagg.triton.engine_stream import EngineServer, EngineStream

HTTP = "http://"
Server = HttpEngineServer | EngineServer
EngineStreams = HttpEngineServer | EngineStream  # what carries a hop: `send`, `forget`, `close`


def connect(url: str) -> Server:
    return HttpEngineServer(url) if url.startswith(HTTP) else EngineServer(url)
