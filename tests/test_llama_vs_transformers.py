"""The numpy decoder against Hugging Face transformers on the same checkpoint: logits and greedy tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import EngineFactory
from safetensors.torch import save_file as save_torch
from transformers import LlamaForCausalLM

from disagg.engine.engine import Request
from disagg.engine.llama import StepInput
from disagg.engine.weights import load_hf_weights


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("hf"))


def hf_model(path):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


PROMPT = [0, 41, 273, 77, 80, 368, 340, 13, 276, 272, 262, 270, 380, 267, 393, 15, 315, 411, 505] * 3


def test_prefill_logits_match_transformers(factory):
    with torch.no_grad():
        expected = hf_model(factory.checkpoint)(torch.tensor([PROMPT])).logits[0, -1].numpy()
    engine = factory.engine()
    blocks = engine.blocks.allocate("x", len(PROMPT))
    got = engine.model.forward([StepInput(np.array(PROMPT), 0, blocks)])[0]
    np.testing.assert_allclose(got, expected, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("tp_pp", [(1, 1), (2, 2)])
def test_greedy_tokens_match_transformers(factory, tp_pp):
    with torch.no_grad():
        out = hf_model(factory.checkpoint).generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = out[0, len(PROMPT) :].tolist()
    assert factory.engine(*tp_pp).generate([Request("r", tuple(PROMPT), 24)])["r"] == expected


def test_llama3_rope_scaling_and_tied_embeddings_match(tmp_path, factory):
    """A checkpoint in another shape: rope_scaling llama3, tied embeddings, bfloat16 weights on disk."""
    cfg = json.loads((factory.checkpoint / "config.json").read_text())
    cfg |= {
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "torch_dtype": "bfloat16",
    }
    weights = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in load_hf_weights(factory.checkpoint).items() if k != "lm_head.weight"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_torch(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        model = hf_model(tmp_path)
        expected_logits = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
    engine = EngineFactory(tmp_path / "engines", checkpoint=tmp_path).engine(2, 2)
    blocks = engine.blocks.allocate("x", len(PROMPT))
    got = engine.model.forward([StepInput(np.array(PROMPT), 0, blocks)])[0]
    np.testing.assert_allclose(got, expected_logits, atol=1e-4, rtol=1e-4)
