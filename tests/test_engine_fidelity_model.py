"""The reference engine's Triton model answers as the tensorrtllm backend does: streamed generation-only
responses (the first carries the context phase's token and the next), context-only results that carry
context_phase_params or are an error, and `stop` requests. Runs the model in-process with a stand-in for
`triton_python_backend_utils` (Triton's Python stub), real engines and a real transfer agent."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
from engine_helpers import EngineFactory
from stub_helpers import FINAL, Sender, Tensor, imported_with_stub

from disagg.engine.engine import ContextPhase, Request
from disagg.engine.loop import EngineLoop
from disagg.engine.sampling import SamplingParams
from disagg.transfer.agent import TransferAgent
from disagg.transfer.params import ContextPhaseParams
from disagg.triton.credential import PARAMETER
from disagg.triton.tensors import EngineCall

PROMPT = tuple(range(3, 43))


KEY = "test-internal-key"


class FakeRequest:
    def __init__(self, request_id: str, request_type: str = "context_and_generation", sender=None, **inputs):
        self.inputs = {name: Tensor(name, np.asarray([value])) for name, value in inputs.items()}
        self._id, self._type, self.sender = request_id, request_type, sender or Sender()

    def request_id(self):
        return self._id

    def parameters(self):
        return json.dumps({"request_type": self._type, PARAMETER: KEY})

    def get_response_sender(self):
        return self.sender


def generate(request_id, max_new, request_type="context_and_generation", streaming=True, sender=None, **extra):
    ids = np.asarray(PROMPT, dtype=np.int32)
    inputs = dict(input_ids=ids, input_lengths=len(ids), request_output_len=max_new, streaming=streaming)
    return FakeRequest(request_id, request_type, sender, **inputs, **extra)


def stop(request_id):
    return FakeRequest(request_id, stop=True)


@pytest.fixture(scope="module")
def engine_model():
    """disagg.triton.engine_model imported against the stand-in stub; removed again afterwards."""
    with imported_with_stub("disagg.triton.engine_model") as module:
        yield module


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("fidelity-model"))


@pytest.fixture
def instance(engine_model, factory):
    """`instance(role)`: one engine model instance (a prefill one has its transfer agent), stopped at the end."""
    made = []

    def make(role: str = "aggregated"):
        model = engine_model.TritonPythonModel.__new__(engine_model.TritonPythonModel)
        model.loop = EngineLoop(factory.engine(role=role))
        model.agent = TransferAgent(model.loop, "tcp") if role == "prefill" else None
        model.streams, model._lock, model.internal_key, model.name = {}, threading.Lock(), KEY, role
        made.append(model)
        return model

    yield make
    for model in made:
        if model.agent is not None:
            model.agent.close()
        model.loop.stop()


def hold_steps(model) -> threading.Semaphore:
    """Makes each of the instance's engine steps wait for a permit the test releases: its requests stay in
    flight in the engine (responses go out on a thread of their own, so a held response would not keep them).
    While a step waits the loop holds its lock: the test reads the pool without it."""
    permits = threading.Semaphore(0)
    step = model.loop.engine.step

    def held_step():
        assert permits.acquire(timeout=10), "no step permit"
        return step()

    model.loop.engine.step = held_step
    return permits


def blocks_used(model) -> int:
    return model.loop.engine.blocks.num_used


def wait_for(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def ids(response) -> list[int]:
    assert response.error is None, response.error.message()
    return response.outputs["output_ids"].reshape(-1).tolist()


@pytest.fixture(scope="module")
def expected(factory) -> list[int]:
    return factory.engine().generate([Request("a", PROMPT, 6)])["a"]


# -- 1. generation-only responses ----------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [True, False])
def test_generation_only_responds_with_the_first_token_again(instance, factory, engine_model, expected, streaming):
    prefill = factory.engine(role="prefill")
    first = prefill.generate([Request("c", PROMPT, 6, "context_only")])["c"]
    ctx = ContextPhase(first[0], prefill.export_kv("c"))
    decode = instance("decode")
    call = EngineCall("g", "generation_only", PROMPT, 6, streaming, SamplingParams(), None, False, False, None)
    sender = Sender()
    decode._start(Request("g", PROMPT, 6, "generation_only", context=ctx), engine_model.Stream(sender, call))
    got = sender.until_final()
    if streaming:  # one response per step: [first, second], then one token each, the last one final
        assert [ids(r) for r, _ in got] == [expected[:2], *([t] for t in expected[2:])]
        assert [flags for _, flags in got] == [0, 0, 0, 0, FINAL]
    else:
        assert [(ids(r), flags) for r, flags in got] == [(expected, FINAL)]


# -- 4. context-only results always carry context_phase_params -------------------------------------------
def test_context_only_answers_once_with_its_token_and_params(instance, expected):
    prefill = instance("prefill")
    request = generate("c1", 6, "context_only")
    prefill.execute([request])
    [(response, flags)] = request.sender.until_final()
    params = ContextPhaseParams.from_bytes(response.outputs["context_phase_params"].tobytes())
    assert flags == FINAL and ids(response) == expected[:1] and params.first_token == expected[0]
    assert prefill.agent.num_held == 1 and prefill.loop.stats().blocks_used == 3  # 40 tokens, 16 per block


def test_a_stop_after_the_context_only_answer_finds_nothing_and_the_kv_stays_for_the_handoff(instance, expected):
    """The backend drops a request's id when it sends the final response (handleStopRequest then finds
    nothing): only a generation request taking the KV, or here the lease, frees it."""
    prefill = instance("prefill")
    request = generate("c3", 6, "context_only")
    prefill.execute([request])
    request.sender.until_final()
    prefill.execute([ask := stop("c3")])
    [(response, flags)] = ask.sender.until_final()
    assert flags == FINAL and response.error is None
    assert prefill.agent.num_held == 1 and prefill.loop.stats().blocks_used == 3


@pytest.mark.parametrize("how", ["max_tokens_1", "first_token_is_end_id"])
def test_context_only_that_ends_in_its_context_phase_is_an_error_and_keeps_no_kv(instance, expected, how):
    """The executor completes such a request before the cache transceiver sees it, so it has no params, and
    the tensorrtllm backend answers a context-only result without them with an error (fillTritonResponse:
    "contextParams must be present in the response"). Nothing is held afterwards."""
    prefill = instance("prefill")
    request = generate("c2", 1, "context_only") if how == "max_tokens_1" else generate("c2", 6, "context_only", end_id=expected[0])
    prefill.execute([request])
    [(response, flags)] = request.sender.until_final()
    assert flags == FINAL and "context_phase_params" not in response.outputs
    assert response.error.message() == "Error encountered while populating response: contextParams must be present in the response"
    assert prefill.agent.num_held == 0 and prefill.loop.stats().blocks_used == 0


# -- 5. stop --------------------------------------------------------------------------------------------
def test_a_stop_for_a_request_this_instance_does_not_know_touches_nothing(instance, expected):
    """Answered as handleStopRequest does: one empty final response, no error; the request of that id on
    another instance, and everything on this one, runs on."""
    one, other = instance(), instance()
    steps = [hold_steps(one), hold_steps(other)]
    live, neighbour = generate("live", 6), generate("neighbour", 6)
    one.execute([live])
    other.execute([neighbour])
    for permits in steps:
        permits.release()  # the prompt's step: each request is now in its engine's batch, held there
    wait_for(lambda: blocks_used(other) == blocks_used(one) == 3)  # 40 + 6 tokens
    for request in (stop("live"), stop("nope")):
        other.execute([request])
        [(response, flags)] = request.sender.until_final()
        assert flags == FINAL and response.error is None and response.outputs == {}
    assert blocks_used(other) == 3
    for permits in steps:
        permits.release(10)
    for request in (live, neighbour):
        assert [t for r, _ in request.sender.until_final() for t in ids(r)] == expected
    assert one.loop.stats().blocks_used == other.loop.stats().blocks_used == 0


def test_the_engine_steps_on_while_a_response_is_being_sent(instance, expected):
    """As the tensorrtllm backend's executor, whose steps never wait for Triton (responses go out from the
    thread of model_instance_state.cc WaitForResponse): a response slow to send does not hold the batch, and
    the request's responses still come in order."""
    model = instance()
    gate = threading.Event()
    slow = generate("slow", 6, sender=Sender(gate))
    model.execute([slow])
    wait_for(lambda: model.loop.stats() == dataclasses.replace(model.loop.stats(), waiting=0, running=0, blocks_used=0))
    assert slow.sender.sent.empty()  # all six tokens computed and the KV freed, not one response out yet
    assert model.loop.stats().delivering == 1  # still the model's until its last response is out (drain counts it)
    gate.set()
    got = slow.sender.until_final()
    assert [t for r, _ in got for t in ids(r)] == expected and len(got) == len(expected)
    wait_for(lambda: model.loop.stats().delivering == 0)


def test_a_stop_without_a_request_id_is_an_error(instance):
    request = stop("")
    instance().execute([request])
    [(response, flags)] = request.sender.until_final()
    assert flags == FINAL and response.error.message() == "Trying to stop a request but request ID is not provided"


def test_a_stop_ends_its_request_with_a_final_response_and_frees_its_kv(instance, expected):
    model = instance()
    permits = hold_steps(model)
    gate = threading.Event()
    live = generate("live", 6, sender=Sender(gate))  # its first response waits until the stop has ended the stream
    model.execute([live])
    permits.release()
    wait_for(lambda: blocks_used(model) == 3)
    stopping = threading.Thread(target=model.execute, args=([request := stop("live")],))
    stopping.start()  # the stop waits for the engine's step under way, frees the KV, then for the held response
    wait_for(lambda: len(model.loop._lock._waiters) == 1)
    permits.release()  # that step: the stop's turn comes before the loop's next one
    wait_for(lambda: blocks_used(model) == 0)
    gate.set()
    stopping.join(10)
    [(response, flags)] = request.sender.until_final()
    assert flags == FINAL and response.error is None and response.outputs == {}
    got = live.sender.until_final()
    assert [ids(r) for r, _ in got] == [expected[:1], []] and got[-1][1] == FINAL
    assert model.loop.stats().blocks_used == 0


def test_perf_metrics_report_the_kv_blocks_a_request_reused(engine_model, factory):
    """With `return_perf_metrics`, the final response carries the executor's KV cache metrics under TB's
    names (fillTritonResponse): blocks newly allocated, reused from the cache, allocated in all."""
    from engine_helpers import LIMITS

    model = engine_model.TritonPythonModel.__new__(engine_model.TritonPythonModel)
    model.loop = EngineLoop(factory.engine(limits=dataclasses.replace(LIMITS, enable_kv_cache_reuse=True)))
    model.agent, model.streams, model._lock, model.internal_key, model.name = None, {}, threading.Lock(), KEY, "aggregated"
    try:
        figures = []
        for i in range(2):
            request = generate(f"m{i}", 6, return_perf_metrics=True)
            model.execute([request])
            final, flags = request.sender.until_final()[-1]
            assert flags == FINAL
            figures.append([int(final.outputs[n].reshape(-1)[0]) for n in
                            ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")])
        # 40 prompt tokens + 6 new in blocks of 16: 3 blocks; the second request finds the first's 2 whole
        # prompt blocks of its first 39 tokens
        assert figures == [[3, 0, 3], [1, 2, 3]]
    finally:
        model.loop.stop()
