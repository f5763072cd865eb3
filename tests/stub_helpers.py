"""A stand-in for `triton_python_backend_utils` (Triton's Python stub), for model code run in-process."""
from __future__ import annotations

import contextlib
import importlib
import queue
import sys
import threading
import types

import numpy as np
import pytest

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class Response:
    def __init__(self, output_tensors=None, error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors or []}
        self.error = error


class Error:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class Sender:
    """Records (response, flags); `gate`, when given, holds the first send until it is set."""

    def __init__(self, gate: threading.Event | None = None):
        self.sent: queue.Queue = queue.Queue()
        self.gate = gate

    def send(self, response=None, flags=0):
        if self.gate is not None:
            self.gate.wait(10)
            self.gate = None
        self.sent.put((response, flags))

    def is_cancelled(self):
        return False

    def until_final(self) -> list:
        got = []
        while not got or got[-1][1] != FINAL:
            got.append(self.sent.get(timeout=30))
        return got


class EngineStream:
    """Stands in for an orchestrator's shared stream to an engine server, up and silent: takes a hop's
    request; the test answers through the handler the hop registered."""

    def send(self, request, on_response):
        self.on_response = on_response

    def forget(self, request_id, on_response):
        pass


def holding(lock) -> threading.Event:
    """Holds `lock` (the stub's) on another thread until the returned event is set: meanwhile every response
    a model sends is queued for its response thread (disagg.triton.response_thread)."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            release.wait(10)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(5)
    return release


def decode_hop(hop, stream, **options):
    """A generation-only hop of request r1 to `decode`, sent on `stream`, run by the disagg.triton.hop module
    imported with this stub; `options`: Hop's keyword arguments."""
    return hop.Hop(stream, hop.Engine("decode", "127.0.0.1:8001"), {"input_ids": np.zeros((1, 2), np.int32)},
                   "r1", "generation_only", "key", hop.load_board.Liveness(), **options)


class EngineResult:
    """An engine response as a hop reads it: `tokens` as output_ids (None: a response without them)."""

    def __init__(self, tokens: list[int] | None):
        self.tokens = tokens

    def as_numpy(self, name):
        return None if name != "output_ids" or self.tokens is None else np.asarray([[self.tokens]], dtype=np.int32)


PB_UTILS = types.ModuleType("triton_python_backend_utils")
PB_UTILS.Tensor, PB_UTILS.InferenceResponse, PB_UTILS.TritonError = Tensor, Response, Error
PB_UTILS.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
PB_UTILS.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)


STUB_IMPORTERS = tuple(f"disagg.triton.{name}" for name in (
    "metrics", "responses", "response_thread", "hop", "client_stream", "routing", "orchestrator"))


@contextlib.contextmanager
def imported_with_stub(*modules: str):
    """`modules` (and the modules of disagg.triton that import the stub, which they may import) imported
    against PB_UTILS, one module or a tuple of them; removed afterwards."""
    names = (*modules, *STUB_IMPORTERS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "triton_python_backend_utils", PB_UTILS)
        for name in names:
            mp.delitem(sys.modules, name, raising=False)
        imported = tuple(importlib.import_module(module) for module in modules)
        yield imported[0] if len(imported) == 1 else imported
        for name in names:
            sys.modules.pop(name, None)
