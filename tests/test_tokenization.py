"""Prompts are tokenized as the checkpoint defines, i.e. as `transformers.AutoTokenizer` does, and the served
greedy text equals `transformers`' own generation for the same prompt.

Upstream's preprocessing model (tensorrtllm_backend `all_models/inflight_batcher_llm/preprocessing/1/model.py`)
encodes with `tokenizer.encode(text, add_special_tokens=...)`, default true: the tokenizer's post-processor
decides whether BOS is added. The generated tiny checkpoint's tokenizer adds none; the variants built here
add BOS with a TemplateProcessing post-processor, as Llama checkpoints do.
"""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from google.protobuf import text_format
from tokenizers import Tokenizer, processors
from transformers import AutoModelForCausalLM, AutoTokenizer
from tritonclient.grpc import model_config_pb2

from disagg.checkpoint import BOS, EOS
from disagg.render import render_repository
from disagg.spec import parse_spec
from disagg.text import added_special_tokens, load_tokenizer, special_tokens_note
from disagg.triton.preprocessing import Limits, Preprocessor, TritonPythonModel, parse_bool
from loadtest.workload import PromptBuilder, load_workload
from tools.stream_client import stream

ROOT = Path(__file__).resolve().parent.parent
LIMITS = Limits(max_input_len=256, max_output_len=319, max_seq_len=320)
PROMPTS = [
    "Call me Ishmael.",
    "a",
    "It was the best of times",
    "The quick brown fox jumps over the lazy dog while the server streams tokens.",
    "def forward(self, x):\n    return x",
    "Unicode: café naïve 東京 ✓",
    "  leading spaces and <s> written out",
]
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def with_post_processor(src: Path, dst: Path, post_processor, **tokenizer_config) -> Path:
    """A copy of checkpoint `src` whose tokenizer.json has `post_processor` and whose tokenizer_config.json
    has `tokenizer_config`'s keys changed (None: removed)."""
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.post_processor = post_processor
    tok.save(str(dst / "tokenizer.json"))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config = {k: v for k, v in {**config, **tokenizer_config}.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dst


def bos_template() -> processors.TemplateProcessing:
    """The post-processor of Llama checkpoints: BOS before the sequence."""
    return processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, 0)])


@pytest.fixture(scope="module")
def bos_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with a BOS-adding post-processor and `add_bos_token: true`, as Llama ships them."""
    return with_post_processor(tiny_checkpoint, tmp_path_factory.mktemp("bos") / "ckpt", bos_template(),
                               add_bos_token=True, add_eos_token=False)


def served_ids(checkpoint: Path, prompt: str, add_special_tokens: bool = True) -> list[int]:
    return Preprocessor.load(checkpoint, LIMITS, add_special_tokens).prepare(prompt.encode(), 8).input_ids.tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_checkpoint_adds_no_bos_like_autotokenizer(tiny_checkpoint, prompt):
    expected = AutoTokenizer.from_pretrained(tiny_checkpoint)(prompt).input_ids
    assert served_ids(tiny_checkpoint, prompt) == expected
    assert expected[0] != 0  # no BOS: the tiny tokenizer has no post-processor


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bos_post_processor_is_applied_like_autotokenizer(bos_checkpoint, prompt):
    expected = AutoTokenizer.from_pretrained(bos_checkpoint)(prompt).input_ids
    assert served_ids(bos_checkpoint, prompt) == expected and expected[0] == 0


def test_bos_written_in_the_prompt_is_the_special_token_as_in_autotokenizer(bos_checkpoint):
    prompt = "x <s> y"  # an added special token in the text is matched as that token, by both
    expected = AutoTokenizer.from_pretrained(bos_checkpoint)(prompt).input_ids
    assert served_ids(bos_checkpoint, prompt) == expected and expected.count(0) == 2


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "LlamaTokenizerFast"])
def test_both_tokenizer_classes_agree_when_config_and_post_processor_agree(tiny_checkpoint, tmp_path, tokenizer_class):
    """LlamaTokenizerFast of transformers 4.x rebuilds the post-processor from add_bos_token/add_eos_token;
    when those agree with tokenizer.json every version gives these ids."""
    ckpt = with_post_processor(tiny_checkpoint, tmp_path / "ckpt", bos_template(), tokenizer_class=tokenizer_class,
                               add_bos_token=True, add_eos_token=False)
    for prompt in PROMPTS[:3]:
        expected = AutoTokenizer.from_pretrained(ckpt)(prompt).input_ids
        assert served_ids(ckpt, prompt) == expected and expected[0] == 0


@pytest.mark.skipif(TRANSFORMERS_MAJOR < 5, reason="transformers 4.x's LlamaTokenizerFast follows tokenizer_config.json")
@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_eos_token": True}])
def test_tokenizer_json_wins_over_disagreeing_flags_as_in_transformers_5(tiny_checkpoint, tmp_path, flags):
    """transformers >= 5 drops add_bos_token/add_eos_token when a tokenizer.json exists, whatever the class."""
    ckpt = with_post_processor(tiny_checkpoint, tmp_path / "ckpt", bos_template(), tokenizer_class="LlamaTokenizerFast",
                               **{"add_bos_token": True, **flags})
    for prompt in PROMPTS[:3]:
        expected = AutoTokenizer.from_pretrained(ckpt)(prompt).input_ids
        assert served_ids(ckpt, prompt) == expected and expected[0] == 0 and expected[-1] != 1
    assert "transformers 4.x" in special_tokens_note(load_tokenizer(ckpt), ckpt)


def test_special_tokens_note_only_where_transformers_versions_differ(tiny_checkpoint, bos_checkpoint, tmp_path):
    assert added_special_tokens(load_tokenizer(tiny_checkpoint)) == ((), ())
    assert added_special_tokens(load_tokenizer(bos_checkpoint)) == ((0,), ())
    assert special_tokens_note(load_tokenizer(tiny_checkpoint), tiny_checkpoint) is None  # PreTrainedTokenizerFast
    assert special_tokens_note(load_tokenizer(bos_checkpoint), bos_checkpoint) is None
    unset = {"add_bos_token": None, "add_eos_token": None}  # LlamaTokenizerFast's defaults: true, false
    llama = with_post_processor(tiny_checkpoint, tmp_path / "llama", bos_template(), tokenizer_class="LlamaTokenizerFast",
                                **unset)
    assert special_tokens_note(load_tokenizer(llama), llama) is None
    eos = with_post_processor(tiny_checkpoint, tmp_path / "eos", bos_template(), tokenizer_class="LlamaTokenizer",
                              add_bos_token=None, add_eos_token=True)
    note = special_tokens_note(load_tokenizer(eos), eos)
    assert "adds [0] before and [] after" in note and "asks for [0] and [1]" in note
    bare = with_post_processor(tiny_checkpoint, tmp_path / "bare", None, tokenizer_class="LlamaTokenizerFast", **unset)
    assert "asks for [0] and []" in special_tokens_note(load_tokenizer(bare), bare)


def rendered_preprocessing_args(spec_overrides: dict, checkpoint: Path, out: Path) -> dict:
    """cpu-tiny with `model` keys overridden, rendered; the `args` Triton gives the preprocessing model."""
    raw = yaml.safe_load((ROOT / "configs" / "cpu-tiny.yaml").read_text())
    raw["model"] = {**raw["model"], "path": str(checkpoint), **spec_overrides}
    spec = parse_spec(raw)
    render_repository(spec, out)
    cfg = text_format.Parse((out / "preprocessing" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    params = {k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}
    return {"model_config": json.dumps({"name": cfg.name, "parameters": params}),
            "model_repository": str(out / "preprocessing")}


@pytest.mark.parametrize(("overrides", "rendered"), [({}, "true"), ({"add_special_tokens": True}, "true"),
                                                     ({"add_special_tokens": False}, "false")])
def test_spec_override_reaches_the_served_tokenization(bos_checkpoint, tmp_path, overrides, rendered):
    args = rendered_preprocessing_args(overrides, bos_checkpoint, tmp_path / "model_repository")
    assert json.loads(args["model_config"])["parameters"]["add_special_tokens"] == {"string_value": rendered}
    model = TritonPythonModel()
    model.initialize(args)
    add = rendered == "true"
    auto = AutoTokenizer.from_pretrained(bos_checkpoint)
    for prompt in PROMPTS:
        expected = auto(prompt, add_special_tokens=add).input_ids
        assert model.pre.prepare(prompt.encode(), 8).input_ids.tolist() == expected
        assert (expected[0] == 0) == add


def test_spec_rejects_a_non_boolean_override():
    raw = yaml.safe_load((ROOT / "configs" / "cpu-tiny.yaml").read_text())
    raw["model"]["add_special_tokens"] = "yes"
    with pytest.raises(Exception, match="model.add_special_tokens"):
        parse_spec(raw)


def test_parameter_spellings_follow_upstream():
    assert all(parse_bool("k", v) for v in ("true", "True", "1", "t", "y", "yes"))
    assert not any(parse_bool("k", v) for v in ("false", "FALSE", "0", "f", "n", "no"))
    with pytest.raises(ValueError, match="add_special_tokens='maybe' is not a boolean"):
        parse_bool("add_special_tokens", "maybe")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_workload_counts_prompt_tokens_as_preprocessing_does(bos_checkpoint, add_special_tokens):
    workload = load_workload("quick")
    requests = workload.requests(bos_checkpoint / "tokenizer.json", add_special_tokens)
    pre = Preprocessor.load(bos_checkpoint, LIMITS, add_special_tokens)
    for r in requests:
        assert r.prompt_tokens == len(pre.prepare(r.prompt.encode(), 8).input_ids) <= workload.max_prompt_tokens
    builder = PromptBuilder(bos_checkpoint / "tokenizer.json", workload, add_special_tokens)
    assert builder.count("hello there") == len(pre.prepare(b"hello there", 8).input_ids)


# --- the served text against transformers' own generation (real tritonserver) ---------------------------

DISAGGREGATED = ("preprocessing", "postprocessing", "prefill", "decode", "disagg_orchestrator", "ensemble")
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    s = start_triton(cpu_tiny_project / "model_repository", "--model-control-mode=explicit",
                     *(f"--load-model={m}" for m in DISAGGREGATED))
    yield s
    s.stop()


@functools.cache
def hf(checkpoint: Path):
    return AutoTokenizer.from_pretrained(checkpoint), AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def transformers_text(checkpoint: Path, ids: list[int]) -> str:
    """Greedy continuation of `ids` by transformers, decoded by AutoTokenizer (special tokens skipped, as
    the served postprocessing does)."""
    tok, model = hf(checkpoint)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.convert_tokens_to_ids(EOS))
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


@pytest.mark.e2e
def test_served_greedy_text_equals_transformers_generate(server, cpu_tiny_project):
    checkpoint = cpu_tiny_project / "build/checkpoints/tiny-llama"
    tok = hf(checkpoint)[0]
    differs_with_bos = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        expected = transformers_text(checkpoint, ids)
        assert expected  # the tiny model writes text for these prompts
        greedy_k = stream(server.grpc_url, "ensemble", prompt, MAX_NEW_TOKENS, top_k=1).text
        greedy_t = stream(server.grpc_url, "ensemble", prompt, MAX_NEW_TOKENS, temperature=0.0, streaming=False).text
        assert greedy_k == greedy_t == expected, prompt
        differs_with_bos += transformers_text(checkpoint, [tok.convert_tokens_to_ids(BOS), *ids]) != expected
    assert differs_with_bos  # a BOS the tokenizer does not add would change the text: this test would see it
