"""Pre/postprocessing logic and model parameters, without Triton."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from disagg.triton.paths import model_param, resolve_path
from disagg.triton.postprocessing import Postprocessor
from disagg.triton.preprocessing import BLS_ONLY, NOT_BUILT_TENSOR, REFUSED, InputError, Limits, Preprocessor, prepare_request
from disagg.text import Detokenizer, load_tokenizer

LIMITS = Limits(max_input_len=256, max_output_len=319, max_seq_len=320)


@pytest.fixture(scope="module")
def pre(tiny_checkpoint) -> Preprocessor:
    return Preprocessor.load(tiny_checkpoint, LIMITS, add_special_tokens=True)


def test_prompt_is_tokenized_as_the_tokenizer_says_with_default_ids(pre):
    p = pre.prepare("hello café".encode(), 16)
    # the tiny tokenizer has no post-processor: no BOS (id 0) or EOS (id 1) is added
    assert p.input_ids.dtype == np.int32 and not {0, 1} & set(p.input_ids.tolist())
    assert p.input_ids.tolist() == pre.tokenizer.encode("hello café").ids
    assert pre.tokenizer.decode(p.input_ids.tolist()) == "hello café"
    assert (p.output_len, p.end_id, p.pad_id) == (16, 1, 1)  # no pad token: pad with EOS
    assert (pre.prepare(b"x", 4, end_id=7, pad_id=8).end_id, pre.prepare(b"x", 4, pad_id=8).pad_id) == (7, 8)


@pytest.mark.parametrize(
    ("query", "max_tokens", "extra", "message"),
    [
        (b"", 8, {}, "text_input: empty prompt"),
        (b"abc\xff", 8, {}, "text_input: not valid UTF-8 (byte 0xff at offset 3)"),
        (b"caf\xc3", 8, {}, "text_input: not valid UTF-8 (byte 0xc3 at offset 3)"),
        (b"x" * 300, 8, {}, "text_input: prompt is 300 tokens, over the limit max_input_len=256"),
        (b"hello", 0, {}, "max_tokens: 0 must be >= 1"),
        (b"hello", -3, {}, "max_tokens: -3 must be >= 1"),
        (b"hello", 5000, {}, "max_tokens: 5000 is over the limit 319"),
        (b"x" * 200, 200, {}, "max_tokens: 200 with a 200-token prompt is over max_seq_len=320 (at most 120 here)"),
        (b"hello", 8, {"end_id": 600}, "end_id: 600 is outside the vocabulary (0..511) or -1 (no end token)"),
        (b"hello", 8, {"pad_id": -1}, "pad_id: -1 is outside the vocabulary (0..511)"),
        (b"hello", 8, {"min_tokens": 9}, "min_tokens: 9 is over max_tokens=8"),
        (b"hello", 8, {"min_length": 9}, "min_length: 9 is over max_tokens=8"),
        (b"hello", 8, {"min_tokens": -1}, "min_tokens: -1 must be >= 0"),
        (b"hello", 8, {"min_tokens": 3, "min_length": 4},
         "min_length: 4 differs from min_tokens=3 (min_length is the older name of min_tokens; send one)"),
        (b"hello", 8, {"seed": 1, "random_seed": 2},
         "random_seed: 2 differs from seed=1 (random_seed is the older name of seed; send one)"),
        (b"hello", 8, {"length_penalty": -1.0}, "length_penalty: -1.0 must be >= 0"),
        (b"hello", 8, {"repetition_penalty": np.float32(1.2).item()},
         "repetition_penalty: 1.2 is not supported by this deployment (only 1: no penalty; the reference engine applies none)"),
        (b"hello", 8, {"presence_penalty": 0.5},
         "presence_penalty: 0.5 is not supported by this deployment (only 0: no penalty; the reference engine applies none)"),
        (b"hello", 8, {"frequency_penalty": -0.5},
         "frequency_penalty: -0.5 is not supported by this deployment (only 0: no penalty; the reference engine applies none)"),
        (b"hello", 8, {"beam_width": 4},
         "beam_width: 4 is not supported by this deployment (only 1: disaggregated serving decodes with beam width 1)"),
        (b"hello", 8, {"num_return_sequences": 2},
         "num_return_sequences: 2 is not supported by this deployment (only 1: one sequence per request)"),
        (b"hello", 8, {"return_log_probs": True},
         "return_log_probs: true is not supported by this deployment (only false: the ensemble has no cum_log_probs/output_log_probs outputs)"),
        (b"hello", 8, {"return_perf_metrics": True},
         "return_perf_metrics: true is not supported by this deployment (only false: the ensemble has no kv_cache_*/*_time_ns outputs)"),
        (b"hello", 8, {"return_kv_cache_reuse_stats": True},
         "return_kv_cache_reuse_stats: true is not supported by this deployment (only false: the ensemble has no kv_cache_* outputs)"),
        (b"hello", 8, {"stop_words": [b"", b"world"]},
         "stop_words: not supported by this deployment (got 1 word(s); only an empty list is accepted)"),
        (b"hello", 8, {"bad_words": [b"x", b"y"]},
         "bad_words: not supported by this deployment (got 2 word(s); only an empty list is accepted)"),
    ],
)
def test_bad_inputs_name_the_field_and_the_limit(pre, query, max_tokens, extra, message):
    with pytest.raises(InputError) as err:
        pre.prepare(query, max_tokens, **extra)
    assert str(err.value) == message


def test_upstream_ensemble_inputs_that_ask_for_nothing_or_for_min_tokens_are_accepted(pre):
    default = pre.prepare(b"hello", 8)
    assert (default.min_tokens, default.seed) == (0, 0)  # 0: no minimum; TensorRT-LLM's default seed
    assert pre.prepare(b"hello", 8, min_tokens=8).min_tokens == 8  # up to max_tokens
    assert pre.prepare(b"hello", 8, min_length=5).min_tokens == 5  # the older name, same meaning
    assert pre.prepare(b"hello", 8, min_tokens=5, min_length=5).min_tokens == 5
    assert pre.prepare(b"hello", 8, random_seed=2**64 - 1).seed == 2**64 - 1
    nothing = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, beam_width=1, num_return_sequences=1,
                   return_log_probs=False, return_context_logits=False, return_generation_logits=False,
                   return_perf_metrics=False, return_kv_cache_reuse_stats=False, stop_words=[b""], bad_words=[])
    accepted = pre.prepare(b"hello", 8, length_penalty=1.0, **nothing)
    assert accepted.input_ids.tolist() == default.input_ids.tolist() and accepted.min_tokens == 0
    with pytest.raises(TypeError, match="unknown option"):
        pre.prepare(b"hello", 8, ignore_eos=True)


def test_inputs_for_what_the_engines_are_not_built_to_do_are_refused_by_name_unless_they_ask_for_nothing(pre):
    assert set(REFUSED) == {*NOT_BUILT_TENSOR, *BLS_ONLY}  # each declared one has its reason
    base = {"QUERY": np.array([[b"hello"]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[8]], dtype=np.int32)}
    with pytest.raises(InputError) as err:
        prepare_request(pre, {**base, "GUIDED_DECODING_GUIDE_TYPE": np.array([[b"json"]], dtype=object)})
    assert str(err.value) == ("guided_decoding_guide_type: not supported by this deployment (guided decoding needs the executor's "
                              "guided-decoding backend, which this deployment does not configure; only an empty or zero value is accepted)")
    with pytest.raises(InputError, match=r"^prompt_embedding_table: not supported .*prompt embedding table"):
        prepare_request(pre, {**base, "PROMPT_EMBEDDING_TABLE": np.ones((1, 2, 4), dtype=np.float16)})
    public = {"text_input": base["QUERY"], "max_tokens": base["REQUEST_OUTPUT_LEN"]}  # tensorrt_llm_bls reads public names
    with pytest.raises(InputError, match=r"^image_input: not supported .*vision encoder"):
        prepare_request(pre, {**public, "image_input": np.ones((1, 1, 3, 2, 2), dtype=np.float16)}, public_names=True)
    nothing = {"EMBEDDING_BIAS_WORDS": np.array([[b""]], dtype=object), "EMBEDDING_BIAS_WEIGHTS": np.zeros((1, 0), np.float32),
               "PROMPT_EMBEDDING_TABLE": np.zeros((1, 2, 4), np.float16), "DECODER_QUERY": np.array([[b""]], dtype=object),
               "LORA_TASK_ID": np.zeros((1, 0), dtype=np.uint64)}
    with pytest.raises(InputError, match=r"^lora_task_id: .*LoRA cache, and these are not; send none\)$"):  # 0 is a task id
        prepare_request(pre, {**base, "LORA_TASK_ID": np.array([[0]], dtype=np.uint64)})
    with pytest.raises(InputError, match=r"^decoder_text_input: "):  # fixed-width strings, as a direct caller may pass them
        prepare_request(pre, {**base, "DECODER_QUERY": np.array([[b"translate"]])})
    accepted = prepare_request(pre, {**base, **nothing})
    assert accepted.input_ids.tolist() == prepare_request(pre, base).input_ids.tolist() and accepted.output_len == 8


def test_the_field_an_error_names_does_not_depend_on_the_order_the_inputs_came_in(pre):
    """Only the inputs sent are looked at, ranked as the checks run: refusals, then the one-value fields."""
    bad = {"lora_task_id": np.array([[3]], dtype=np.uint64), "image_input": np.ones((1, 1, 3, 2, 2), dtype=np.float16),
           "max_tokens": np.array([[8, 9]], dtype=np.int32), "text_input": np.array([[b"a", b"b"]], dtype=object)}
    named = set()
    for order in (list(bad), list(reversed(bad))):
        with pytest.raises(InputError) as err:
            prepare_request(pre, {name: bad[name] for name in order}, public_names=True)
        named.add(str(err.value).split(":")[0])
    first_refused = next(f for f in (*NOT_BUILT_TENSOR, *BLS_ONLY) if f in bad)
    assert named == {first_refused}
    scalars = {"max_tokens": bad["max_tokens"], "text_input": bad["text_input"]}
    for order in (["max_tokens", "text_input"], ["text_input", "max_tokens"]):
        with pytest.raises(InputError, match=r"^text_input: expected one value per request, got 2"):
            prepare_request(pre, {name: scalars[name] for name in order}, public_names=True)


def test_postprocessing_emits_only_new_text_and_whole_sequences_decode_fully(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    post = Postprocessor(Detokenizer.from_tokenizer(tokenizer))
    ids = tokenizer.encode("a 東京").ids
    split = len(ids) - 1  # the last token finishes 京
    padded = np.array([[*ids, 0, 0]], dtype=np.int32)  # [beams=1, T] with padding past sequence_length
    lengths = np.array([len(ids)], dtype=np.int32)
    assert post.texts(padded, lengths, prefix_len=None, final=False) == ["a 東京".encode()]
    assert post.texts(padded, lengths, prefix_len=split, final=False) == ["京".encode()]
    assert post.texts(padded[:, :split], lengths - 1, prefix_len=0, final=False) == ["a 東".encode()]


def test_postprocessing_flushes_a_partial_character_only_on_the_final_response(tiny_checkpoint):
    """A generation that stops inside a character: the streamed text still equals tokenizer.decode."""
    tokenizer = load_tokenizer(tiny_checkpoint)
    post = Postprocessor(Detokenizer.from_tokenizer(tokenizer))
    ids = tokenizer.encode("ok ✓").ids[:-1]  # ✓ is three one-byte tokens here; drop its last byte
    assert tokenizer.decode(ids).endswith("\ufffd")
    tokens, lengths = np.array([ids], dtype=np.int32), np.array([len(ids)], dtype=np.int32)
    held = post.texts(tokens, lengths, prefix_len=0, final=False)[0].decode()
    flushed = post.texts(tokens, lengths, prefix_len=len(ids), final=True)[0].decode()  # no new tokens
    assert (held, flushed) == ("ok ", "\ufffd")
    assert held + flushed == tokenizer.decode(ids)
    assert post.texts(tokens, lengths, prefix_len=len(ids), final=False) == [b""]


def _args(tmp_path, **params) -> dict:
    repo = tmp_path / "model_repository"
    (repo / "preprocessing").mkdir(parents=True, exist_ok=True)
    config = {"name": "preprocessing", "parameters": {k: {"string_value": v} for k, v in params.items()}}
    return {"model_config": json.dumps(config), "model_repository": str(repo / "preprocessing")}


def test_model_param_and_resolve_path_against_the_repository_root(tmp_path):
    (tmp_path / "build" / "tok").mkdir(parents=True)
    args = _args(tmp_path, tokenizer_dir="../build/tok", missing_dir="../build/nope", max_input_len="256")
    assert model_param(args, "max_input_len") == "256"
    assert resolve_path(args, "tokenizer_dir") == (tmp_path / "build" / "tok").resolve()
    with pytest.raises(ValueError, match="model 'preprocessing': parameter 'max_output_len' is missing"):
        model_param(args, "max_output_len")
    with pytest.raises(FileNotFoundError, match=r"model 'preprocessing': parameter missing_dir='../build/nope' points to"):
        resolve_path(args, "missing_dir")


def test_a_prompt_that_tokenizes_to_nothing_is_refused(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer, normalizers

    ckpt = tmp_path / "strip"
    shutil.copytree(tiny_checkpoint, ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.normalizer = normalizers.Strip()  # "   " normalizes to "": no token, and this tokenizer adds none
    tok.save(str(ckpt / "tokenizer.json"))
    pre = Preprocessor.load(ckpt, LIMITS)
    with pytest.raises(InputError, match="text_input: the prompt tokenizes to no token at all"):
        pre.prepare(b"   ", 4)
    assert pre.prepare(b" a ", 4).input_ids.size == 1


def test_add_special_tokens_parameter_is_read_and_checked(tiny_checkpoint, tmp_path):
    from disagg.triton.preprocessing import TritonPythonModel

    limits = {"max_input_len": "256", "max_output_len": "319", "max_seq_len": "320"}
    for value, expected in (("true", True), ("false", False), ("0", False)):
        model = TritonPythonModel()
        model.initialize(_args(tmp_path, tokenizer_dir=str(tiny_checkpoint), add_special_tokens=value, **limits))
        assert model.pre.add_special_tokens is expected
    with pytest.raises(ValueError, match="add_special_tokens='sometimes' is not a boolean"):
        TritonPythonModel().initialize(_args(tmp_path, tokenizer_dir=str(tiny_checkpoint), add_special_tokens="sometimes", **limits))
    with pytest.raises(ValueError, match="parameter 'add_special_tokens' is missing"):
        TritonPythonModel().initialize(_args(tmp_path, tokenizer_dir=str(tiny_checkpoint), **limits))
