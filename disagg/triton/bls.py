"""`tensorrt_llm_bls`: the ensemble's text contract served by one decoupled Python model.

Upstream's tensorrt_llm_bls (tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm_bls) takes
the ensemble's inputs and answers with `text_output`, calling preprocessing, tensorrt_llm and
postprocessing itself. This one does the same work in process: it validates and tokenizes with
preprocessing's own Preprocessor, orchestrates as the ensemble's orchestrator does (this class is that
orchestrator), and detokenizes with postprocessing's detokenizer, keeping each sequence's UTF-8 state
(disagg.text.IncrementalText) instead of decoding a few earlier tokens again per response. So a client
gets the same text, token counts and input errors as through `ensemble`, while each token crosses one
Python process on its way out (the ensemble: orchestrator, then postprocessing, each a Python-backend
round trip, and the ensemble's bookkeeping between them) and a prompt none before its first hop.

Called directly, the model learns of a client's cancellation from its response sender (checked every
SENDER_CHECK_S); no cancel flag is made, since no postprocessing would raise it.
"""
from __future__ import annotations

import traceback
from collections.abc import Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.text import Detokenizer, IncrementalText
from disagg.triton import cancel_board, text_contract
from disagg.triton.metrics import STUB_LOCK
from disagg.triton.client_stream import ClientStream
from disagg.triton.orchestrator import TritonPythonModel as Orchestrator
from disagg.triton.postprocessing import Postprocessor
from disagg.triton.preprocessing import (
    BLS_ONLY, NOT_BUILT_TENSOR, TENSOR_OF, WORD_LISTS, InputError, asks_for_something, load_preprocessor, prepare_request,
)

PASSED_ON = {i.public: i.to for i in text_contract.PASSED_ON}  # public input -> orchestrator input
ORCHESTRATOR_NAME = {h.output: h.to for h in text_contract.PREPROCESSED}  # preprocessing output -> orchestrator input


class TextStream(ClientStream):
    """Responses as `ensemble` gives them, each one's new tokens detokenized here as they come."""

    def __init__(self, out, sender, streaming: bool, stream_id: str, detokenizer: Detokenizer, coalesce_backlog: int):
        super().__init__(out, sender, streaming, stream_id, coalesce_backlog)
        self.text = IncrementalText(detokenizer)

    def _outputs(self, ids: list[int], prefix_length: int, final: bool) -> dict[str, np.ndarray]:
        new = ids[prefix_length:]
        return {
            "text_output": np.asarray([[self.text.add(new, final).encode()]], dtype=object),
            "num_output_tokens": np.asarray([[len(new)]], dtype=np.uint32),
        }


class TritonPythonModel(Orchestrator):
    read_inputs = frozenset((*TENSOR_OF, *WORD_LISTS, *PASSED_ON))
    refused_inputs = frozenset((*NOT_BUILT_TENSOR, *BLS_ONLY))

    def initialize(self, args):
        super().initialize(args)
        self.pre = load_preprocessor(args, "tensorrt_llm_bls")
        self.detokenizer = Postprocessor.from_parameters(args, self.pre.tokenizer).detokenizer

    def _copy_input(self, name: str, tensor) -> np.ndarray | None:
        """As the orchestrator, but an input for what the engines are not built to do is only looked at: one that
        asks for something becomes a marker its refusal needs (an image or a LoRA table is not copied under
        the stub's lock to be refused), one that asks for nothing is left out."""
        if name in self.refused_inputs:
            return np.ones((1, 1), dtype=np.bool_) if asks_for_something(name, tensor.as_numpy()) else None
        return super()._copy_input(name, tensor)

    def _client_stream(self, sender, streaming: bool, stream_id: str) -> ClientStream:
        return TextStream(self.out, sender, streaming, stream_id, self.detokenizer, self.coalesce_backlog)

    def _cancel_flag(self, request_id: str) -> cancel_board.NoFlag:
        return cancel_board.NoFlag()

    def _serve(self, arrays: dict[str, np.ndarray], sender, arrival: float) -> Iterator[object]:
        """Validates and tokenizes, then serves the request as the orchestrator would."""
        try:
            prepared = prepare_request(self.pre, arrays, public_names=True)
        except InputError as exc:
            self.out.fail(sender, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the client must get an answer; the worker would swallow it
            with STUB_LOCK:
                pb_utils.Logger.log_error(f"tensorrt_llm_bls: {traceback.format_exc()}")
            self.out.fail(sender, f"tensorrt_llm_bls: internal error: {exc}")
            return
        passed = {PASSED_ON[name]: array for name, array in arrays.items() if name in PASSED_ON}
        prepared_arrays = {ORCHESTRATOR_NAME[name]: array for name, array in prepared.outputs().items()}
        yield from super()._serve({**prepared_arrays, **passed}, sender, arrival)
