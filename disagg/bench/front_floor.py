"""`front_floor`: the least a Python model in front of the engines can add to a first token, for
`python -m disagg.bench front` (which writes it into its own repository only).

A decoupled Python model that forwards each request's token ids to the prefill engine, over the transport
the orchestrator reaches engines with (disagg.triton.transport), and sends the engine's response back from
the transport's reader thread: no tokenizing, no routing, no worker thread, no decode hop. It asks for one
token as a whole request (context_and_generation), the same prompt step as a context-only request's, so that
prefill holds no KV handoff for a decode that never comes. Against the engine called directly it adds one
Triton Python model and one hop and nothing else, which is the floor under tensorrt_llm_bls's TTFT; what
tensorrt_llm_bls adds beyond it is its own work.
"""
from __future__ import annotations

import itertools
import os
import traceback

import numpy as np

import triton_python_backend_utils as pb_utils

from disagg.triton import credential, load_board, responses
from disagg.triton.contract import DEFAULT_ENGINE_URL, ENGINE_URL_ENV
from disagg.triton.engine_request import EngineRequest
from disagg.triton.transport import connect
from disagg.triton.metrics import STUB_LOCK
from disagg.triton.paths import repository_root

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _answer(sender):
    """The stream's handler for one request: each engine response goes straight to the client."""
    def on_response(result, error: str | None, final: bool) -> None:
        with STUB_LOCK:
            try:
                if error is not None:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)), flags=FINAL)
                elif (ids := result.as_numpy("output_ids")) is not None:
                    responses.send(sender, [pb_utils.Tensor("output_ids", ids.reshape(1, 1, -1))], FINAL if final else 0)
                elif final:
                    sender.send(flags=FINAL)
            except Exception:  # noqa: BLE001 - raised here, it would end the stream's reader and every request on it
                pb_utils.Logger.log_error(f"front_floor: {traceback.format_exc()}")
    return on_response


class TritonPythonModel:
    def initialize(self, args):
        self.key = credential.internal_key(load_board.board_key(repository_root(args)))
        self.server = connect(os.environ.get(ENGINE_URL_ENV, DEFAULT_ENGINE_URL))
        self.ids = itertools.count()

    def execute(self, requests):
        accepted = [({t.name(): t.as_numpy().copy() for t in request.inputs()}, request.get_response_sender())
                    for request in requests]  # without the stub's lock, as the orchestrator's execute
        for inputs, sender in accepted:
            inputs["request_output_len"] = np.ones((1, 1), dtype=np.int32)
            request = EngineRequest("prefill", f"floor-{next(self.ids)}", inputs,
                                    {"request_type": "context_and_generation", credential.PARAMETER: self.key}, ("output_ids",))
            try:
                self.server.shared("prefill").send(request, _answer(sender))
            except ConnectionError as exc:
                with STUB_LOCK:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
        return None

    def finalize(self):
        self.server.close()
