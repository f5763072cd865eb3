"""The text-level request of upstream's ensemble, in one place: its public inputs, the tensor each goes
to, and the names preprocessing's outputs take on their way to the orchestrator.

The configs of `ensemble`, `aggregated`, `preprocessing` and `tensorrt_llm_bls` are rendered from these
(disagg.repository gives every template these names), preprocessing reads its inputs by them and
tensorrt_llm_bls renames its inputs with them, so what the ensemble wires and what the BLS does in
process cannot disagree.

The inputs are upstream's (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt),
under the names of v0.17.0-v0.19.0 and of commit c2e65b8 on (`min_length`/`min_tokens`,
`random_seed`/`seed`), plus `service_class`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextInput:
    """A public input (dims [1] unless `words`): its Triton type and the input of the step that reads it."""

    public: str
    type: str
    to: str  # preprocessing's tensor, or the orchestrator's input
    optional: bool = True
    words: bool = False  # a list of strings (dims [-1])


# Validated by preprocessing (disagg.triton.preprocessing), under its tensor names.
CHECKED = (
    TextInput("text_input", "STRING", "QUERY", optional=False),
    TextInput("max_tokens", "INT32", "REQUEST_OUTPUT_LEN", optional=False),
    TextInput("end_id", "INT32", "END_ID"),
    TextInput("pad_id", "INT32", "PAD_ID"),
    TextInput("num_return_sequences", "INT32", "NUM_RETURN_SEQUENCES"),
    TextInput("length_penalty", "FP32", "LENGTH_PENALTY"),
    TextInput("repetition_penalty", "FP32", "REPETITION_PENALTY"),
    TextInput("min_tokens", "INT32", "MIN_TOKENS"),
    TextInput("min_length", "INT32", "MIN_LENGTH"),
    TextInput("presence_penalty", "FP32", "PRESENCE_PENALTY"),
    TextInput("frequency_penalty", "FP32", "FREQUENCY_PENALTY"),
    TextInput("seed", "UINT64", "SEED"),
    TextInput("random_seed", "UINT64", "RANDOM_SEED"),
    TextInput("return_log_probs", "BOOL", "RETURN_LOG_PROBS"),
    TextInput("return_context_logits", "BOOL", "RETURN_CONTEXT_LOGITS"),
    TextInput("return_generation_logits", "BOOL", "RETURN_GENERATION_LOGITS"),
    TextInput("return_perf_metrics", "BOOL", "RETURN_PERF_METRICS"),
    TextInput("return_kv_cache_reuse_stats", "BOOL", "RETURN_KV_CACHE_REUSE_STATS"),
    TextInput("beam_width", "INT32", "BEAM_WIDTH"),
    TextInput("stop_words", "STRING", "STOP_WORDS_DICT", words=True),
    TextInput("bad_words", "STRING", "BAD_WORDS_DICT", words=True),
)

# Taken by the orchestrator as they are, under its own names.
PASSED_ON = (
    TextInput("stream", "BOOL", "streaming"),
    TextInput("exclude_input_in_output", "BOOL", "exclude_input_in_output"),
    TextInput("temperature", "FP32", "temperature"),
    TextInput("top_k", "INT32", "runtime_top_k"),
    TextInput("top_p", "FP32", "runtime_top_p"),
    TextInput("service_class", "STRING", "service_class"),  # not upstream's: orchestrator.service_classes in the spec
)


@dataclass(frozen=True)
class Handed:
    """One of preprocessing's outputs: the ensemble tensor carrying it, and the orchestrator input taking it."""

    output: str
    wire: str
    to: str


PREPROCESSED = (
    Handed("INPUT_ID", "_INPUT_ID", "input_ids"),
    Handed("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN", "input_lengths"),
    Handed("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN", "request_output_len"),
    Handed("OUT_END_ID", "_END_ID", "end_id"),
    Handed("OUT_PAD_ID", "_PAD_ID", "pad_id"),
    Handed("OUT_MIN_TOKENS", "_MIN_TOKENS", "min_tokens"),
    Handed("OUT_SEED", "_SEED", "seed"),
)

TEMPLATE_NAMES = {"checked_inputs": CHECKED, "passed_on_inputs": PASSED_ON, "preprocessed": PREPROCESSED}
