"""Generates a small, deterministic Hugging Face Llama checkpoint so a fresh machine needs no download.

The output is an ordinary HF model directory: `config.json`, `model.safetensors` (seeded weights), a
byte-level BPE `tokenizer.json` trained here with the `tokenizers` library and a `tokenizer_config.json`
that `transformers.AutoTokenizer` loads (as PreTrainedTokenizerFast). The tokenizer has no post-processor:
it adds no BOS/EOS to a prompt, and the served prompts follow it. Same preset + seed gives the same
bytes, so builds that depend on it are reproducible and incremental.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<s>", "</s>"

# Public-domain prose plus code-like text: enough variety for a few hundred BPE merges.
_CORPUS = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,
it was the season of Darkness, it was the spring of hope, it was the winter of despair.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,
and nothing particular to interest me on shore, I thought I would sail about a little and see the
watery part of the world. It is a way I have of driving off the spleen and regulating the circulation.
In the beginning the Universe was created. This has made a lot of people very angry and been widely
regarded as a bad move. The quick brown fox jumps over the lazy dog while the server streams tokens.
Prefill reads the whole prompt at once and is bound by compute; decode emits one token per step and is
bound by memory bandwidth. Splitting them lets each phase run with its own batch size and parallelism.
def forward(self, x):
    h = x + self.attention(self.norm(x))
    return h + self.mlp(self.post_norm(h))
for i in range(10): print(i, i * i, "tokens per second", 3.14159)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096. Punctuation: (a, b) [c; d] {e: f} <g/> "h" 'i' -- ok!
Unicode: café naïve façade jalapeño über 東京 пример λ → ∞ ✓
"""


@dataclass(frozen=True)
class Preset:
    """Shape of a generated Llama model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    init_std: float = 0.08

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.hidden_size // self.num_attention_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32",
        }


PRESETS: dict[str, Preset] = {
    # Tests: 4 KV heads so TP in {1, 2, 4} is valid and TP=3 is not; 4 layers for PP in {1, 2, 4}.
    "tiny": Preset(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    ),
    # Benchmarks: ~110 MB of float32 weights, large enough that decode is bound by weight reads.
    "bench-100mb": Preset(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        init_std=0.04,
    ),
}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the embedded corpus; ids 0 and 1 are BOS and EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _printable(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Tokens that decode on their own to printable text (not a stray byte of a multi-byte character)."""
    keep = np.zeros(vocab_size, dtype=bool)
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i], skip_special_tokens=False)
        keep[i] = bool(text) and "\ufffd" not in text and text.isprintable()
    return keep


def _weights(preset: Preset, seed: int, printable: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f, v = preset.hidden_size, preset.intermediate_size, preset.vocab_size
    head_dim = d // preset.num_attention_heads
    kv = preset.num_key_value_heads * head_dim

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) * preset.init_std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {"model.embed_tokens.weight": (rng.standard_normal((v, d)) * 0.5).astype(np.float32)}
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = dense(d, d)
        w[p + "self_attn.k_proj.weight"] = dense(kv, d)
        w[p + "self_attn.v_proj.weight"] = dense(kv, d)
        w[p + "self_attn.o_proj.weight"] = dense(d, d)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = dense(f, d)
        w[p + "mlp.up_proj.weight"] = dense(f, d)
        w[p + "mlp.down_proj.weight"] = dense(d, f)
    w["model.norm.weight"] = norm()
    if not preset.tie_word_embeddings:
        # Random weights give random text; silencing tokens that are only fragments of a character
        # makes that text readable word salad instead of a stream of U+FFFD.
        w["lm_head.weight"] = dense(v, d) * 4 * printable[:, None]
    return w


# A Zephyr-style chat template: BOS, then each turn as <|role|>, its text and EOS; refuses unknown roles.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant, not ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def tokenizer_config() -> dict:
    """tokenizer_config.json: the special tokens by name, the chat template, and the class transformers
    loads, which keeps tokenizer.json's post-processor as it is (none: nothing added); add_bos_token/
    add_eos_token say the same, for readers and for tools that read them."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generate_checkpoint(out_dir: str | Path, preset_name: str, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json for `preset_name`
    into `out_dir`."""
    preset = PRESETS[preset_name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(preset.vocab_size)
    if tokenizer.get_vocab_size() > preset.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size={preset.vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    (out / "config.json").write_text(json.dumps(preset.hf_config(), indent=2, sort_keys=True))
    save_file(_weights(preset, seed, _printable(tokenizer, preset.vocab_size)), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
