"""`front_floor`: the least a Python model in front of the engines can add to a first token, for
`python -m disagg.bench front` (which writes it into its own repository only).

A decoupled Python model that forwards each request as it came (token ids) to the prefill engine as
context_only, over the engine server's shared gRPC stream as the orchestrator reaches engines
(disagg.triton.engine_stream), and sends the engine's one response back from the stream's reader thread: no
tokenizing, no routing, no worker thread, no decode hop. Against the engine called directly it adds one
Triton Python model and one gRPC hop and nothing else, which is the floor under tensorrt_llm_bls's TTFT;
what tensorrt_llm_bls adds beyond it is its own work.
"""
from __future__ import annotations

import itertools
import os

import triton_python_backend_utils as pb_utils

from disagg.triton import credential, load_board, responses
from disagg.triton.contract import DEFAULT_ENGINE_URL, ENGINE_URL_ENV
from disagg.triton.engine_stream import EngineServer, infer_request
from disagg.triton.metrics import STUB_LOCK
from disagg.triton.paths import repository_root

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _answer(sender):
    """The stream's handler for one request: each engine response goes straight to the client."""
    def on_response(result, error: str | None, final: bool) -> None:
        with STUB_LOCK:
            if error is not None:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)), flags=FINAL)
            elif (ids := result.as_numpy("output_ids")) is not None:
                responses.send(sender, [pb_utils.Tensor("output_ids", ids.reshape(1, 1, -1))], FINAL if final else 0)
            elif final:
                sender.send(flags=FINAL)
    return on_response


class TritonPythonModel:
    def initialize(self, args):
        self.key = credential.internal_key(load_board.board_key(repository_root(args)))
        self.server = EngineServer(os.environ.get(ENGINE_URL_ENV, DEFAULT_ENGINE_URL))
        self.ids = itertools.count()

    def execute(self, requests):
        with STUB_LOCK:
            accepted = [({t.name(): t.as_numpy().copy() for t in request.inputs()}, request.get_response_sender())
                        for request in requests]
        for inputs, sender in accepted:
            request = infer_request("prefill", f"floor-{next(self.ids)}", inputs,
                                    {"request_type": "context_only", credential.PARAMETER: self.key}, ("output_ids",))
            try:
                self.server.shared().send(request, _answer(sender))
            except ConnectionError as exc:
                with STUB_LOCK:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
        return None

    def finalize(self):
        self.server.close()
