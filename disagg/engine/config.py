"""Model and engine configuration: what a Hugging Face `config.json` and an engine dir's `config.json` say."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ENGINE_FORMAT = "disagg-reference-engine/1"


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a Hugging Face Llama `config.json` the decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, in the reference engine's float32."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        arch = hf.get("architectures") or ["LlamaForCausalLM"]
        if hf.get("model_type", "llama") != "llama" or arch[0] != "LlamaForCausalLM":
            raise ValueError(f"model_type={hf.get('model_type')!r} architectures={arch}: only LlamaForCausalLM is supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> LlamaConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


@dataclass(frozen=True)
class Mapping:
    """How an engine is split over ranks; rank = pp_rank * tp_size + tp_rank, as in TensorRT-LLM."""

    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def stage_layers(self, num_layers: int) -> list[range]:
        """Layers of each pipeline stage: an even split, earlier stages take the remainder."""
        base, extra = divmod(num_layers, self.pp_size)
        stages, start = [], 0
        for s in range(self.pp_size):
            n = base + (1 if s < extra else 0)
            stages.append(range(start, start + n))
            start += n
        return stages


def engine_max_input_len(max_seq_len: int, max_num_tokens: int, chunked_context: bool) -> int:
    """The longest prompt an engine accepts, whatever the request type, as TensorRT-LLM's trtGptModel.h sets
    `mMaxInputLen` (context FMHA and packed input on): `max_seq_len - 1` with chunked context, else
    `min(max_seq_len - 1, max_num_tokens)`, a whole prompt in one step."""
    if chunked_context:
        return max_seq_len - 1
    return min(max_seq_len - 1, max_num_tokens)


@dataclass(frozen=True)
class BuildConfig:
    """A role's limits, baked into its engine like `trtllm-build`'s build_config."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_blocks: int
    enable_chunked_context: bool = False  # absent from engines built before it existed: off
    enable_kv_cache_reuse: bool = False  # prefix caching (disagg.engine.kv_cache.BlockManager); absent: off

    @property
    def engine_max_input_len(self) -> int:
        """The longest prompt the engine accepts (`max_input_len` itself only bounds what preprocessing lets
        through)."""
        return engine_max_input_len(self.max_seq_len, self.max_num_tokens, self.enable_chunked_context)


@dataclass(frozen=True)
class EngineConfig:
    """Contents of an engine dir's `config.json`."""

    role: str
    model: LlamaConfig
    mapping: Mapping
    build: BuildConfig
    dtype: str = "float32"

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": ENGINE_FORMAT,
                "role": self.role,
                "pretrained_config": {
                    "architecture": "LlamaForCausalLM",
                    "dtype": self.dtype,
                    **asdict(self.model),
                    "mapping": {**asdict(self.mapping), "world_size": self.mapping.world_size},
                },
                "build_config": asdict(self.build),
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def load(cls, engine_dir: str | Path) -> EngineConfig:
        path = Path(engine_dir) / "config.json"
        raw = json.loads(path.read_text())
        if raw.get("version") != ENGINE_FORMAT:
            raise ValueError(f"{path}: engine format {raw.get('version')!r}, expected {ENGINE_FORMAT!r}; rebuild it")
        pre = dict(raw["pretrained_config"])
        mapping = pre.pop("mapping")
        pre.pop("architecture"), pre.pop("dtype")
        return cls(
            role=raw["role"],
            model=LlamaConfig(**pre),
            mapping=Mapping(tp_size=mapping["tp_size"], pp_size=mapping["pp_size"]),
            build=BuildConfig(**raw["build_config"]),
            dtype=raw["pretrained_config"]["dtype"],
        )
