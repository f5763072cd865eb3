"""`preprocessing` model: prompt text -> token ids, and the edge validation of every user-facing input.

Tokenization follows the checkpoint, like upstream's preprocessing model (tensorrtllm_backend,
`all_models/inflight_batcher_llm/preprocessing/1/model.py`): its parameter `add_special_tokens` (default
true) goes to `tokenizer.encode(text, add_special_tokens=...)`, so the tokenizer's own post-processor
decides whether BOS (or anything else) is added. Here the `tokenizers` library applies tokenizer.json's
post-processor (disagg/text.py `encode_prompt`), which gives the ids of `AutoTokenizer` without
importing transformers; the spec's `model.add_special_tokens` renders the parameter.

A bad request gets a Triton error naming the public field and the limit (`text_input: empty prompt`,
`max_tokens: 5000 is over the limit 319`); it never fails the other requests of the batch. Limits come
from the model's parameters, which render.py fills from the deployment spec's roles.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from disagg.text import encode_prompt, load_tokenizer, special_ids, special_tokens_note
from disagg.triton.paths import model_param, resolve_path


class InputError(ValueError):
    """A request input is invalid; the message starts with the public field name."""


@dataclass(frozen=True)
class Limits:
    max_input_len: int  # prompt tokens, special tokens (BOS) included
    max_output_len: int  # new tokens per request
    max_seq_len: int  # prompt + new tokens


@dataclass(frozen=True)
class Prepared:
    input_ids: np.ndarray  # [prompt_len] int32
    output_len: int
    end_id: int
    pad_id: int


def decode_prompt(raw: bytes) -> str:
    if not raw:
        raise InputError("text_input: empty prompt")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"text_input: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def check_prompt_len(n_tokens: int, limits: Limits) -> None:
    if n_tokens == 0:
        raise InputError("text_input: the prompt tokenizes to no token at all")
    if n_tokens > limits.max_input_len:
        raise InputError(
            f"text_input: prompt is {n_tokens} tokens, over the limit max_input_len={limits.max_input_len}"
        )


def check_max_tokens(value: int, prompt_len: int, limits: Limits) -> None:
    if value < 1:
        raise InputError(f"max_tokens: {value} must be >= 1")
    if value > limits.max_output_len:
        raise InputError(f"max_tokens: {value} is over the limit {limits.max_output_len}")
    if prompt_len + value > limits.max_seq_len:
        room = limits.max_seq_len - prompt_len
        raise InputError(
            f"max_tokens: {value} with a {prompt_len}-token prompt is over max_seq_len={limits.max_seq_len} "
            f"(at most {room} here)"
        )


def check_token_id(field: str, value: int, vocab_size: int) -> None:
    if not 0 <= value < vocab_size:
        raise InputError(f"{field}: {value} is outside the vocabulary (0..{vocab_size - 1})")


@dataclass(frozen=True)
class Preprocessor:
    tokenizer: Tokenizer
    limits: Limits
    add_special_tokens: bool  # run tokenizer.json's post-processor (BOS etc. as the checkpoint defines)
    end_id: int
    pad_id: int

    @classmethod
    def load(cls, tokenizer_dir: Path, limits: Limits, add_special_tokens: bool = True) -> Preprocessor:
        tokenizer = load_tokenizer(tokenizer_dir)
        ids = special_ids(tokenizer, tokenizer_dir)
        if ids.eos is None:
            raise ValueError(f"{tokenizer_dir}: no EOS token in tokenizer_config.json or config.json")
        return cls(tokenizer, limits, add_special_tokens, ids.eos, ids.eos if ids.pad is None else ids.pad)

    def prepare(self, query: bytes, max_tokens: int, end_id: int | None = None, pad_id: int | None = None) -> Prepared:
        """Validates one request and tokenizes its prompt; raises InputError on the first bad field."""
        text = decode_prompt(query)
        ids = encode_prompt(self.tokenizer, text, self.add_special_tokens)
        check_prompt_len(len(ids), self.limits)
        check_max_tokens(max_tokens, len(ids), self.limits)
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        for field, value in (("end_id", end_id), ("pad_id", pad_id)):
            if value is not None:
                check_token_id(field, value, vocab)
        return Prepared(
            input_ids=np.asarray(ids, dtype=np.int32),
            output_len=max_tokens,
            end_id=self.end_id if end_id is None else end_id,
            pad_id=self.pad_id if pad_id is None else pad_id,
        )


def parse_bool(key: str, value: str) -> bool:
    """A boolean model parameter, spelled as upstream's preprocessing accepts it; anything else is an
    error here (upstream falls back to true with a warning)."""
    word = value.strip().lower()
    if word in ("true", "1", "t", "y", "yes"):
        return True
    if word in ("false", "0", "f", "n", "no"):
        return False
    raise ValueError(f"preprocessing: parameter {key}={value!r} is not a boolean (true/false)")


def _one(pb_utils, request, name: str, field: str):
    """The single value of input `name` (shape [1, 1]: batch of one) as a Python scalar, None if not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InputError(f"{field}: expected one value per request, got {values.size} (send one prompt per request)")
    return values[0] if values.dtype == object else values[0].item()


def _scalar(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)  # [batch=1, 1]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        limits = Limits(
            max_input_len=int(model_param(args, "max_input_len")),
            max_output_len=int(model_param(args, "max_output_len")),
            max_seq_len=int(model_param(args, "max_seq_len")),
        )
        tokenizer_dir = resolve_path(args, "tokenizer_dir")
        add_special_tokens = parse_bool("add_special_tokens", model_param(args, "add_special_tokens"))
        self.pre = Preprocessor.load(tokenizer_dir, limits, add_special_tokens)
        note = special_tokens_note(self.pre.tokenizer, tokenizer_dir) if self.pre.add_special_tokens else None
        if note:
            import triton_python_backend_utils as pb_utils

            pb_utils.Logger.log_warn(f"preprocessing: {note}")

    def _respond(self, pb_utils, request):
        p = self.pre.prepare(
            _one(pb_utils, request, "QUERY", "text_input"),
            _one(pb_utils, request, "REQUEST_OUTPUT_LEN", "max_tokens"),
            _one(pb_utils, request, "END_ID", "end_id"),
            _one(pb_utils, request, "PAD_ID", "pad_id"),
        )
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", p.input_ids[None, :]),
            pb_utils.Tensor("REQUEST_INPUT_LEN", _scalar(p.input_ids.size)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", _scalar(p.output_len)),
            pb_utils.Tensor("OUT_END_ID", _scalar(p.end_id)),
            pb_utils.Tensor("OUT_PAD_ID", _scalar(p.pad_id)),
        ])

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils  # exists only inside the Python backend stub

        responses = []
        for request in requests:
            try:
                responses.append(self._respond(pb_utils, request))
            except InputError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
            except Exception as exc:  # noqa: BLE001 - one broken request must not fail the batch
                pb_utils.Logger.log_error(f"preprocessing: {traceback.format_exc()}")
                error = pb_utils.TritonError(f"preprocessing: internal error: {exc}")
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses
