"""One shared gRPC stream per engine model (disagg.triton.engine_stream), against an in-process gRPC server
that answers ModelStreamInfer as Triton 2.51 does: every response names its request id, errors included."""
from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from disagg.triton.engine_request import EngineRequest
from disagg.triton.engine_stream import EngineServer


class FakeEngine(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers each request for model "m" or "n" with `count` token responses (token = its index) and an empty
    final one, all requests' responses interleaved; a request for model "bad" gets one error response instead,
    and one for a model it does not have the error Triton gives (`opened` counts those as first requests of a
    stream)."""

    def __init__(self):
        self.hold = threading.Event()  # set: answer; clear: hold every response back
        self.hold.set()
        self.refusing = threading.Event()  # set: answer requests for unknown models; clear: hold those answers back
        self.refusing.set()
        self.seen: queue.SimpleQueue = queue.SimpleQueue()
        self.opened = 0
        self.streams: list[list[str]] = []  # the models asked for on each stream, in order

    def ModelStreamInfer(self, request_iterator, context):
        pending = []
        models = []
        self.streams.append(models)
        for i, request in enumerate(request_iterator):
            models.append(request.model_name)
            if request.model_name not in ("m", "n", "bad"):
                self.opened += i == 0
                self.refusing.wait()
                yield service_pb2.ModelStreamInferResponse(
                    error_message=f"[request id: {request.id}] Request for unknown model: '{request.model_name}' is not found",
                    infer_response=service_pb2.ModelInferResponse(id=request.id))
                continue
            self.seen.put(request)
            if request.model_name == "bad":
                yield service_pb2.ModelStreamInferResponse(
                    error_message=f"[request id: {request.id}] bad input", infer_response=service_pb2.ModelInferResponse(id=request.id))
                continue
            count = int(np.frombuffer(request.raw_input_contents[0], dtype=np.int32)[0])
            pending.append((request.id, count))
            if len(pending) < 2 and count:
                continue  # wait for a second request, so the two are answered interleaved
            self.hold.wait()
            yield from self._interleaved(pending)
            pending = []
        yield from self._interleaved(pending)

    @staticmethod
    def _interleaved(pending):
        for step in range(max((c for _, c in pending), default=0) + 1):
            for request_id, count in pending:
                if step > count:
                    continue
                response = service_pb2.ModelInferResponse(id=request_id, model_name="m")
                if step < count:
                    response.outputs.add(name="output_ids", datatype="INT32", shape=[1, 1])
                    response.raw_output_contents.append(np.array([step], dtype=np.int32).tobytes())
                response.parameters["triton_final_response"].bool_param = step == count
                yield service_pb2.ModelStreamInferResponse(infer_response=response)


def _serve(fake: FakeEngine, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.fixture
def engine():
    fake = FakeEngine()
    server, port = _serve(fake)
    client = EngineServer(f"127.0.0.1:{port}")
    yield fake, server, client
    client.close()
    server.stop(grace=None)


class Collector:
    def __init__(self):
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, result, error, final):
        self.items.put((None if result is None else result.as_numpy("output_ids"), error, final))

    def all(self, timeout=5.0) -> list:
        out = []
        while not out or not out[-1][2]:
            out.append(self.items.get(timeout=timeout))
        return out


def _request(request_id: str, count: int, model: str = "m"):
    return EngineRequest(model, request_id, {"n": np.array([[count]], dtype=np.int32), "flag": np.array([[True]])},
                         {"request_type": "generation_only"}, ("output_ids",))


def test_interleaved_responses_reach_their_own_request(engine):
    _, _, client = engine
    stream = client.shared("m")
    a, b = Collector(), Collector()
    stream.send(_request("a", 3), a)
    stream.send(_request("b", 5), b)
    got_a, got_b = a.all(), b.all()
    assert [int(ids[0, 0]) for ids, _, _ in got_a[:-1]] == [0, 1, 2]
    assert [int(ids[0, 0]) for ids, _, _ in got_b[:-1]] == [0, 1, 2, 3, 4]
    assert got_a[-1] == (None, None, True) and got_b[-1] == (None, None, True)
    assert stream.in_flight() == 0  # a final response drops its handler


def test_a_stream_opens_with_a_request_that_no_handler_claims(engine):
    """The opening keeps the stream's first real request from being the one Triton holds until the stream ends."""
    fake, _, client = engine
    stream = client.shared("m")
    answer = Collector()
    stream.send(_request("first", 0), answer)
    assert answer.all() == [(None, None, True)]
    assert fake.opened == 1 and fake.seen.get(timeout=5).id == "first"
    assert stream.broken is None and stream.in_flight() == 0


def test_nothing_follows_the_opening_on_a_stream_until_its_refusal_is_back(engine):
    """Triton 2.51 writes a refusal without waiting for a decoupled response's write, and does not send a
    decoupled response that found the refusal's write in flight until another response comes."""
    fake, _, client = engine
    fake.refusing.clear()
    stream = client.shared("m")
    sending = threading.Thread(target=stream.send, args=(_request("first", 0), Collector()))
    sending.start()
    time.sleep(0.3)
    assert sending.is_alive() and fake.seen.empty()  # the request waits for the opening's answer
    fake.refusing.set()
    sending.join(5)
    assert fake.seen.get(timeout=5).id == "first"


def test_a_stream_whose_opening_is_never_answered_refuses_its_requests(engine, monkeypatch):
    from disagg.triton import engine_stream

    fake, _, client = engine
    fake.refusing.clear()
    monkeypatch.setattr(engine_stream, "OPENING_WAIT_S", 0.2)
    try:
        with pytest.raises(ConnectionError, match="did not answer the stream's opening within 0.2 s"):
            client.shared("m").send(_request("first", 0), Collector())
        assert fake.seen.empty()
    finally:
        fake.refusing.set()


def test_each_model_has_a_stream_of_its_own_on_its_servers_channel(engine):
    """A refusal (a model being reloaded) must not share a stream with another model's streaming responses:
    Triton 2.51 writes both at once and aborts (README, Known problems)."""
    fake, _, client = engine
    answers = {request_id: Collector() for request_id in ("m1", "m2", "n1", "n2", "r")}
    for request_id, answer in answers.items():
        model = {"m": "m", "n": "n", "r": "reloading"}[request_id[0]]
        client.shared(model).send(_request(request_id, 2, model=model), answer)
    assert [len(answers[request_id].all()) for request_id in ("m1", "m2", "n1", "n2")] == [3, 3, 3, 3]
    assert answers["r"].all() == [(None, "[request id: r] Request for unknown model: 'reloading' is not found", True)]
    assert client.shared("m") is client.shared("m") and client.shared("m") is not client.shared("n")
    assert sorted(fake.streams) == [["disagg-stream-opening", "m", "m"], ["disagg-stream-opening", "n", "n"],
                                    ["disagg-stream-opening", "reloading"]]


def test_the_request_is_sent_as_tritonclient_sends_it(engine):
    fake, _, client = engine
    client.shared("m").send(_request("x", 0), Collector())
    seen = fake.seen.get(timeout=5)
    assert (seen.model_name, seen.id) == ("m", "x")
    assert [(t.name, t.datatype, list(t.shape)) for t in seen.inputs] == [("n", "INT32", [1, 1]), ("flag", "BOOL", [1, 1])]
    assert seen.raw_input_contents[1] == b"\x01"
    assert seen.parameters["request_type"].string_param == "generation_only"
    assert seen.parameters["triton_enable_empty_final_response"].bool_param
    assert [o.name for o in seen.outputs] == ["output_ids"]


def test_an_error_is_final_for_its_request_only(engine):
    _, _, client = engine
    stream = client.shared("m")
    bad, good, other = Collector(), Collector(), Collector()
    stream.send(_request("good-1", 2), good)
    stream.send(_request("bad-1", 0, model="bad"), bad)
    stream.send(_request("good-2", 1), other)
    assert bad.all() == [(None, "[request id: bad-1] bad input", True)]
    assert len(good.all()) == 3 and len(other.all()) == 2
    with pytest.raises(ValueError, match="already in flight"):
        held = Collector()
        stream.send(_request("dup", 1), held)  # answered only with a second request: stays in flight
        stream.send(_request("dup", 1), held)


def test_a_handler_that_raises_loses_its_own_request_only(engine, capfd):
    _, _, client = engine
    stream = client.shared("m")
    calls = []

    def broken(result, error, final):
        calls.append(final)
        raise KeyError("output_ids")

    good = Collector()
    stream.send(_request("broken", 3), broken)
    stream.send(_request("good", 3), good)
    assert [int(ids[0, 0]) for ids, _, _ in good.all()[:-1]] == [0, 1, 2]
    assert calls == [False] and stream.broken is None and stream.in_flight() == 0  # its handler forgotten at once
    assert "KeyError: 'output_ids'" in capfd.readouterr().err
    after = Collector()
    stream.send(_request("after", 0), after)  # the stream still carries requests
    assert after.all() == [(None, None, True)]


def test_forgetting_an_ended_request_leaves_a_new_one_under_its_id_alone(engine):
    _, _, client = engine
    stream = client.shared("m")
    first, second = Collector(), Collector()
    stream.send(_request("same", 0, model="bad"), first)
    first.all()
    stream.send(_request("same", 2), second)
    stream.forget("same", first)  # the first request's late cleanup
    stream.send(_request("other", 1), Collector())
    assert [int(ids[0, 0]) for ids, _, _ in second.all()[:-1]] == [0, 1]


def test_a_broken_stream_fails_what_it_carries_and_the_next_request_gets_a_new_one(engine):
    fake, server, client = engine
    fake.hold.clear()
    stream = client.shared("m")
    waiting = Collector()
    stream.send(_request("w1", 1), waiting)
    stream.send(_request("w2", 1), Collector())
    fake.seen.get(timeout=5), fake.seen.get(timeout=5)
    server.stop(grace=None)
    fake.hold.set()
    (ids, error, final), = waiting.all()
    assert ids is None and final and error.startswith("stream to the engine server broke: ")
    with pytest.raises(ConnectionError, match="broke"):
        stream.send(_request("late", 1), Collector())
    # Requests while the server is away fail at once, each on a new stream...
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        failed = Collector()
        try:
            client.shared("m").send(_request("down", 0), failed)
            (_, error, _), = failed.all()
        except ConnectionError as exc:  # the new stream broke before the request was on it
            error = str(exc)
        assert "UNAVAILABLE" in error
        time.sleep(0.25)
    # ... and once it is back on its port, the next one goes through at once, on a new channel: the old
    # one would refuse calls for its reconnect back-off (1 s, 1.6 s, 2.6 s ... after repeated failures).
    again, _ = _serve(FakeEngine(), int(client.url.rsplit(":", 1)[1]))
    try:
        answer = Collector()
        assert client.shared("m") is not stream
        client.shared("m").send(_request("after", 0), answer)
        assert answer.all(timeout=0.5) == [(None, None, True)]
    finally:
        again.stop(grace=None)
