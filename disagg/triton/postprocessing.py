"""`postprocessing` model: token ids -> text, stateless and UTF-8 safe for streaming.

Each row of TOKENS_BATCH holds SEQUENCE_LENGTH valid tokens; the first PREFIX_LENGTH of them were already
turned into text by an earlier response and are context only (disagg.text.Detokenizer). Without
PREFIX_LENGTH a row is a whole sequence and decodes exactly like `tokenizer.decode`; with it, a trailing
incomplete character is held back for the next response, unless IS_FINAL says there is none: then its
bytes become U+FFFD, as `tokenizer.decode` gives them. An orchestrator therefore sends, in every
streamed response, the new tokens plus at least the 3 tokens before them (or all tokens so far).

STREAM_ID names the orchestrator request's cancel flag. Through an ensemble this model is the only one
Triton tells of a client's cancellation, so it raises the flag (disagg.triton.cancel_board). Asking
Triton is an IPC round trip, so it asks only when STREAM_ID is not empty (the orchestrator names the
flag on one response in every 50 ms).

NUM_OUTPUT_TOKENS counts the tokens each response's text was decoded from (SEQUENCE_LENGTH minus
PREFIX_LENGTH, summed over beams), so a client can count usage without a tokenizer of its own.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from disagg.text import Detokenizer, load_tokenizer
from disagg.triton import cancel_board, load_board
from disagg.triton.paths import model_param, repository_root, resolve_path


@dataclass(frozen=True)
class Postprocessor:
    detokenizer: Detokenizer

    def texts(self, tokens: np.ndarray, lengths: np.ndarray, prefix_len: int | None, final: bool) -> list[bytes]:
        """tokens: [beams, T], lengths: [beams] -> UTF-8 text of each beam's new tokens."""
        out = []
        for row, length in zip(tokens, lengths):
            ids = row[: int(length)].tolist()
            start = prefix_len or 0
            text = self.detokenizer.incremental_text(ids[:start], ids[start:], final=final or prefix_len is None)
            out.append(text.encode())
        return out

    @classmethod
    def from_parameters(cls, args: dict, tokenizer: Tokenizer | None = None) -> Postprocessor:
        """As a model's parameters describe it (postprocessing's, or tensorrt_llm_bls's, which has its
        tokenizer loaded already)."""
        tokenizer = tokenizer or load_tokenizer(resolve_path(args, "tokenizer_dir"))
        skip = model_param(args, "skip_special_tokens").lower() == "true"
        return cls(Detokenizer.from_tokenizer(tokenizer, skip_special_tokens=skip))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.post = Postprocessor.from_parameters(args)
        self.board_key = load_board.board_key(repository_root(args))

    def _respond(self, pb_utils, request):
        inputs = {t.name(): t for t in request.inputs()}  # pb_utils.get_input_tensor_by_name lists them per call

        def optional(name: str, default) -> list:  # [batch, 1] -> one value per row
            tensor = inputs.get(name)
            return [default] * len(tokens) if tensor is None else tensor.as_numpy().reshape(-1).tolist()

        tokens = inputs["TOKENS_BATCH"].as_numpy()  # [batch, beams, T]
        lengths = inputs["SEQUENCE_LENGTH"].as_numpy()  # [batch, beams]
        prefix_lens, finals = optional("PREFIX_LENGTH", None), optional("IS_FINAL", False)
        stream_ids = [sid for sid in optional("STREAM_ID", b"") if sid]  # b"": no check asked for this time
        if stream_ids and request.is_cancelled():
            for stream_id in stream_ids:
                cancel_board.raise_flag(self.board_key, stream_id.decode())
        texts = [self.post.texts(t, n, p, f) for t, n, p, f in zip(tokens, lengths, prefix_lens, finals)]
        counts = [[sum(n.tolist()) - (p or 0) * len(n)] for n, p in zip(lengths, prefix_lens)]
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object)),
            pb_utils.Tensor("NUM_OUTPUT_TOKENS", np.array(counts, dtype=np.uint32)),
        ])

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils  # exists only inside the Python backend stub

        responses = []
        for request in requests:
            try:
                responses.append(self._respond(pb_utils, request))
            except Exception as exc:  # noqa: BLE001 - one broken request must not fail the batch
                pb_utils.Logger.log_error(f"postprocessing: {traceback.format_exc()}")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {exc}")))
        return responses
