"""The text-level request of upstream's ensemble, in one place: its public inputs, the tensor each goes
to, and the names preprocessing's outputs take on their way to the orchestrator.

The configs of `ensemble`, `aggregated`, `preprocessing` and `tensorrt_llm_bls` are rendered from these
(disagg.repository gives every template these names), preprocessing reads its inputs by them and
tensorrt_llm_bls renames its inputs with them, so what the ensemble wires and what the BLS does in
process cannot disagree.

The inputs are upstream's (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt and
tensorrt_llm_bls/config.pbtxt, their types and dims), under the names of v0.17.0-v0.19.0 and of commit
c2e65b8 on (`min_length`/`min_tokens`, `random_seed`/`seed`, `return_kv_cache_reuse_stats`/
`return_perf_metrics`; v0.19.0 added `guided_decoding_guide_type`/`guided_decoding_guide`), plus
`service_class`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextInput:
    """A public input: its Triton type and dims, and the input of the step that reads it."""

    public: str
    type: str
    to: str  # preprocessing's tensor, or the orchestrator's input ("": read by tensorrt_llm_bls alone)
    optional: bool = True
    dims: tuple[int, ...] = (1,)  # one value per request, or a list (stop_words) or table
    ragged: bool = False


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
    TextInput("stop_words", "STRING", "STOP_WORDS_DICT", dims=(-1,)),
    TextInput("bad_words", "STRING", "BAD_WORDS_DICT", dims=(-1,)),
)

# Upstream's inputs for what these engines are not built to do: declared, so that a client sending one gets
# preprocessing's refusal naming it, not Triton's "unexpected inference input"; accepted when they ask for
# nothing (disagg.triton.preprocessing, REFUSED).
NOT_BUILT = (
    TextInput("decoder_text_input", "STRING", "DECODER_QUERY"),
    TextInput("prompt_embedding_table", "FP16", "PROMPT_EMBEDDING_TABLE", dims=(-1, -1)),
    TextInput("prompt_vocab_size", "INT32", "PROMPT_VOCAB_SIZE"),
    TextInput("prompt_table_extra_id", "UINT64", "PROMPT_TABLE_EXTRA_ID"),
    TextInput("embedding_bias_words", "STRING", "EMBEDDING_BIAS_WORDS", dims=(-1,)),
    TextInput("embedding_bias_weights", "FP32", "EMBEDDING_BIAS_WEIGHTS", dims=(-1,)),
    TextInput("lora_task_id", "UINT64", "LORA_TASK_ID"),
    TextInput("lora_weights", "FP16", "LORA_WEIGHTS", dims=(-1, -1), ragged=True),
    TextInput("lora_config", "INT32", "LORA_CONFIG", dims=(-1, 3), ragged=True),
    TextInput("guided_decoding_guide_type", "STRING", "GUIDED_DECODING_GUIDE_TYPE", ragged=True),
    TextInput("guided_decoding_guide", "STRING", "GUIDED_DECODING_GUIDE", ragged=True),
)
# Those upstream's tensorrt_llm_bls declares beside the ensemble's (multimodal input, a draft model): refused
# by tensorrt_llm_bls itself, which reads them by their public names.
NOT_BUILT_BLS = (
    TextInput("image_input", "FP16", "", dims=(-1, 3, -1, -1)),
    TextInput("image_bytes_input", "UINT8", "", dims=(-1, -1, -1, -1)),
    TextInput("image_url_input", "STRING", ""),
    TextInput("video_bytes_input", "UINT8", "", dims=(-1, -1, -1, -1)),
    TextInput("num_draft_tokens", "INT32", ""),
    TextInput("use_draft_logits", "BOOL", ""),
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

TEMPLATE_NAMES = {"checked_inputs": CHECKED + NOT_BUILT, "bls_inputs": NOT_BUILT_BLS, "passed_on_inputs": PASSED_ON,
                  "preprocessed": PREPROCESSED}
