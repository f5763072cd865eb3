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

The ensembles declare the optional inputs of upstream's `ensemble` (all_models/inflight_batcher_llm/
ensemble/config.pbtxt, v0.17.0-v0.19.0 and after commit c2e65b8, which renamed `min_length`/`random_seed`
to `min_tokens`/`seed`), since clients such as genai-perf send them and Triton refuses an input a model
does not declare. Each is honoured or refused here by name, never ignored: `min_tokens`/`min_length` and
`seed`/`random_seed` (either name, same meaning) go on to the engines; `length_penalty` is accepted and,
as in TensorRT-LLM at beam width 1, changes nothing (only its beam search reads it); the inputs in
ONLY_DEFAULT are refused unless they hold the value that asks for nothing, `stop_words`/`bad_words`
unless empty, and those of REFUSED (upstream's inputs for LoRA, prompt tuning, guided decoding and the like,
which these engines are not built for) unless empty or zero. (`exclude_input_in_output` and `stream` go to
the orchestrator.)
"""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tokenizers import Tokenizer

from disagg.engine.sampling import NO_END_ID
from disagg.text import encode_prompt, load_tokenizer, special_ids, special_tokens_note
from disagg.triton.paths import model_param, resolve_path
from disagg.triton.text_contract import CHECKED, NOT_BUILT, NOT_BUILT_BLS


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
    min_tokens: int = 0  # end_id cannot end the request before this many new tokens (0: no minimum)
    seed: int = 0  # TensorRT-LLM's default seed (layers/defaultDecodingParams.h getSeed)

    def outputs(self) -> dict[str, np.ndarray]:
        """preprocessing's output tensors, [batch=1, ...]."""
        return {
            "INPUT_ID": self.input_ids[None, :],
            "REQUEST_INPUT_LEN": _scalar(self.input_ids.size),
            "REQUEST_OUTPUT_LEN": _scalar(self.output_len),
            "OUT_END_ID": _scalar(self.end_id),
            "OUT_PAD_ID": _scalar(self.pad_id),
            "OUT_MIN_TOKENS": _scalar(self.min_tokens),
            "OUT_SEED": _scalar(self.seed, np.uint64),
        }


# Upstream ensemble inputs accepted only at the value that asks for nothing: field -> (that value, why).
ONLY_DEFAULT = {
    "repetition_penalty": (1.0, "no penalty; the reference engine applies none"),
    "presence_penalty": (0.0, "no penalty; the reference engine applies none"),
    "frequency_penalty": (0.0, "no penalty; the reference engine applies none"),
    "beam_width": (1, "disaggregated serving decodes with beam width 1"),
    "num_return_sequences": (1, "one sequence per request"),
    "return_log_probs": (False, "the ensemble has no cum_log_probs/output_log_probs outputs"),
    "return_context_logits": (False, "the ensemble has no context_logits output"),
    "return_generation_logits": (False, "the ensemble has no generation_logits output"),
    "return_perf_metrics": (False, "the ensemble has no kv_cache_*/*_time_ns outputs"),
    "return_kv_cache_reuse_stats": (False, "the ensemble has no kv_cache_* outputs"),
}
WORD_LISTS = {i.public: i.to for i in CHECKED if i.dims != (1,)}
# Upstream inputs for what these engines are not built to do (text_contract.NOT_BUILT, NOT_BUILT_BLS): refused
# unless they ask for nothing (empty, or only empty strings, zeros and false; an id: not sent at all).
_PROMPT_TUNING = "prompt tuning needs engines built with a prompt embedding table, and these are not"
_LORA = "LoRA needs engines built with the LoRA plugin and a LoRA cache, and these are not"
_GUIDED = "guided decoding needs the executor's guided-decoding backend, which this deployment does not configure"
_MULTIMODAL = "multimodal requests need a vision encoder, and this deployment has none"
_DRAFT = "speculative decoding needs a draft model, and this deployment has none"
REFUSED = {
    "decoder_text_input": "encoder-decoder models only; these engines are decoder-only",
    "prompt_embedding_table": _PROMPT_TUNING, "prompt_vocab_size": _PROMPT_TUNING, "prompt_table_extra_id": _PROMPT_TUNING,
    "embedding_bias_words": "no embedding bias is applied here", "embedding_bias_weights": "no embedding bias is applied here",
    "lora_task_id": _LORA, "lora_weights": _LORA, "lora_config": _LORA,
    "guided_decoding_guide_type": _GUIDED, "guided_decoding_guide": _GUIDED,
    "image_input": _MULTIMODAL, "image_bytes_input": _MULTIMODAL, "image_url_input": _MULTIMODAL, "video_bytes_input": _MULTIMODAL,
    "num_draft_tokens": _DRAFT, "use_draft_logits": _DRAFT,
}
_OPTIONS = frozenset((*ONLY_DEFAULT, *WORD_LISTS))  # Preprocessor.prepare's **options
NOT_BUILT_TENSOR = {i.public: i.to for i in NOT_BUILT}
BLS_ONLY = tuple(i.public for i in NOT_BUILT_BLS)
IDS = ("lora_task_id", "prompt_table_extra_id")  # any value names something: task 0 is a task
# The older names upstream's ensemble had up to tensorrtllm_backend v0.19.0 (renamed in commit c2e65b8).
OLDER_NAMES = {"min_tokens": "min_length", "seed": "random_seed"}


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
    if field == "end_id" and value == NO_END_ID:
        return
    if not 0 <= value < vocab_size:
        also = f" or {NO_END_ID} (no end token)" if field == "end_id" else ""
        raise InputError(f"{field}: {value} is outside the vocabulary (0..{vocab_size - 1}){also}")


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def either_name(name: str, value, old_value):
    """The value of an input upstream renamed (`min_tokens`, formerly `min_length`), sent under either name;
    both may be sent only with the same value."""
    old = OLDER_NAMES[name]
    if value is not None and old_value is not None and value != old_value:
        raise InputError(f"{old}: {old_value} differs from {name}={value} ({old} is the older name of {name}; send one)")
    if value is not None:
        return name, value
    return old, old_value


def check_min_tokens(field: str, value: int, max_tokens: int) -> None:
    if value < 0:
        raise InputError(f"{field}: {value} must be >= 0")
    if value > max_tokens:
        raise InputError(f"{field}: {value} is over max_tokens={max_tokens}")


def check_seed(field: str, value: int) -> None:
    if not 0 <= value < 2**64:
        raise InputError(f"{field}: {value} must fit in uint64")


def check_length_penalty(value: float) -> None:
    """Accepted and without effect at beam width 1, as in TensorRT-LLM (only beam search reads it); the
    executor's SamplingConfig refuses a negative one (checkLengthPenalty)."""
    if not math.isfinite(value) or value < 0:
        raise InputError(f"length_penalty: {value} must be >= 0")


def refuse_unsupported(options: dict) -> None:
    """`options`: public field -> value sent (None: not sent), for the fields of ONLY_DEFAULT and WORD_LISTS."""
    for field, (default, why) in ONLY_DEFAULT.items():
        value = options.get(field)
        if value is not None and value != default:
            raise InputError(f"{field}: {_show(value)} is not supported by this deployment (only {_show(default)}: {why})")
    for field in WORD_LISTS:
        words = [w for w in options.get(field) or () if w]
        if words:
            raise InputError(
                f"{field}: not supported by this deployment (got {len(words)} word(s); only an empty list is accepted)"
            )


def asks_for_something(field: str, array: np.ndarray) -> bool:
    """Whether an input of REFUSED, sent, asks for anything: any value of an id, else a non-empty string or a
    non-zero value."""
    if array.size == 0:
        return False
    if field in IDS:
        return True
    return any(map(bool, array.reshape(-1))) if array.dtype.kind in "OSU" else bool(np.any(array))


def refuse_not_built(field: str, array: np.ndarray | None) -> None:
    if array is not None and asks_for_something(field, array):
        accepted = "send none" if field in IDS else "only an empty or zero value is accepted"
        raise InputError(f"{field}: not supported by this deployment ({REFUSED[field]}; {accepted})")


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

    @classmethod
    def from_parameters(cls, param: Callable[[str], str], tokenizer_dir: Path) -> Preprocessor:
        """The Preprocessor of a preprocessing-like model, from its config's parameters (`param(key)`: the value)."""
        limits = Limits(int(param("max_input_len")), int(param("max_output_len")), int(param("max_seq_len")))
        return cls.load(tokenizer_dir, limits, parse_bool("add_special_tokens", param("add_special_tokens")))

    def prepare(
        self, query: bytes, max_tokens: int, end_id: int | None = None, pad_id: int | None = None, *,
        min_tokens: int | None = None, min_length: int | None = None, seed: int | None = None,
        random_seed: int | None = None, length_penalty: float | None = None, **options,
    ) -> Prepared:
        """Validates one request and tokenizes its prompt; raises InputError on the first bad field.
        `options`: the fields of ONLY_DEFAULT and WORD_LISTS that the request sent."""
        unknown = options.keys() - _OPTIONS
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        refuse_unsupported(options)
        text = decode_prompt(query)
        ids = encode_prompt(self.tokenizer, text, self.add_special_tokens)
        check_prompt_len(len(ids), self.limits)
        check_max_tokens(max_tokens, len(ids), self.limits)
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        for field, value in (("end_id", end_id), ("pad_id", pad_id)):
            if value is not None:
                check_token_id(field, value, vocab)
        min_field, min_value = either_name("min_tokens", min_tokens, min_length)
        if min_value is not None:
            check_min_tokens(min_field, min_value, max_tokens)
        seed_field, seed_value = either_name("seed", seed, random_seed)
        if seed_value is not None:
            check_seed(seed_field, seed_value)
        if length_penalty is not None:
            check_length_penalty(length_penalty)
        return Prepared(
            input_ids=np.asarray(ids, dtype=np.int32),
            output_len=max_tokens,
            end_id=self.end_id if end_id is None else end_id,
            pad_id=self.pad_id if pad_id is None else pad_id,
            min_tokens=0 if min_value is None else min_value,
            seed=0 if seed_value is None else seed_value,
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


# Public field (the ensemble's input) -> preprocessing's input tensor, for every one-value field validated here.
TENSOR_OF = {i.public: i.to for i in CHECKED if i.dims == (1,)}


def _one(array: np.ndarray | None, field: str):
    """The single value of an input (shape [1, 1]: batch of one) as a Python scalar, None if not sent."""
    if array is None:
        return None
    values = array.reshape(-1)
    if values.size != 1:
        raise InputError(f"{field}: expected one value per request, got {values.size} (send one prompt per request)")
    return values[0] if values.dtype == object else values[0].item()


def _words(array: np.ndarray | None) -> list[bytes] | None:
    """The strings of a [1, n] STRING input (stop_words, bad_words), None if not sent."""
    return None if array is None else [bytes(w) for w in array.reshape(-1)]


# The fields prepare_request reads, ranked in the order of their checks (refusals, the one-value fields, the word
# lists), and the public field of each of preprocessing's input tensors.
_RANK = {field: i for i, field in enumerate((*NOT_BUILT_TENSOR, *BLS_ONLY, *TENSOR_OF, *WORD_LISTS))}
_REFUSED_FIELDS = frozenset((*NOT_BUILT_TENSOR, *BLS_ONLY))
_FIELD_OF_TENSOR = {tensor: field for field, tensor in {**NOT_BUILT_TENSOR, **TENSOR_OF, **WORD_LISTS}.items()}


def prepare_request(pre: Preprocessor, arrays: dict[str, np.ndarray], public_names: bool = False) -> Prepared:
    """Validates and tokenizes one request given its inputs by name: preprocessing's tensor names, or the
    public field names (`public_names`: tensorrt_llm_bls, which takes the ensemble's inputs itself). Only the
    inputs sent are looked at (a request sends a few of some forty), in the order of the checks, so the field
    an error names does not depend on the order they came in."""
    named = arrays.items() if public_names else ((_FIELD_OF_TENSOR.get(tensor), array) for tensor, array in arrays.items())
    scalars, words = {}, {}
    for field, array in sorted(((f, a) for f, a in named if f in _RANK), key=lambda sent: _RANK[sent[0]]):
        if field in _REFUSED_FIELDS:
            refuse_not_built(field, array)
        elif field in WORD_LISTS:
            words[field] = _words(array)
        else:
            scalars[field] = _one(array, field)
    return pre.prepare(scalars.pop("text_input", None), scalars.pop("max_tokens", None), **scalars, **words)


def _scalar(value: int, dtype=np.int32) -> np.ndarray:
    return np.array([[value]], dtype=dtype)  # [batch=1, 1]


def load_preprocessor(args: dict, model: str) -> Preprocessor:
    """The Preprocessor a model's parameters describe (preprocessing's, or tensorrt_llm_bls's); logs a note
    when the tokenizer adds special tokens the checkpoint may not expect."""
    tokenizer_dir = resolve_path(args, "tokenizer_dir")
    pre = Preprocessor.from_parameters(lambda key: model_param(args, key), tokenizer_dir)
    note = special_tokens_note(pre.tokenizer, tokenizer_dir) if pre.add_special_tokens else None
    if note:
        import triton_python_backend_utils as pb_utils

        pb_utils.Logger.log_warn(f"{model}: {note}")
    return pre


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.pre = load_preprocessor(args, "preprocessing")

    def _respond(self, pb_utils, request):
        p = prepare_request(self.pre, {t.name(): t.as_numpy() for t in request.inputs()})
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in p.outputs().items()])

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
