"""Hugging Face checkpoint -> per-rank weight shards, as `convert_checkpoint.py --tp_size --pp_size` does.

TP splits attention by heads (q/k/v rows, o columns) and the MLP by intermediate columns (gate/up rows,
down columns); PP gives each stage a contiguous run of layers, the embedding to the first stage and
the final norm + LM head to the last. Shards keep Hugging Face names and [out, in] orientation.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import safetensors
from safetensors.numpy import load_file, save_file

from disagg.engine.config import EngineConfig, LlamaConfig, Mapping

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _load_file_any_dtype(path: Path) -> dict[str, np.ndarray]:
    """Loads one safetensors file as float32; bfloat16 (which numpy lacks) is widened from its raw bits."""
    try:
        return {k: v.astype(np.float32, copy=False) for k, v in load_file(str(path)).items()}
    except (TypeError, safetensors.SafetensorError):
        pass
    out = {}
    for name, t in safetensors.deserialize(path.read_bytes()):
        raw = np.frombuffer(bytes(t["data"]), dtype=np.uint8)
        if t["dtype"] in ("bfloat16", "BF16"):
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.view(_DTYPES[t["dtype"].upper()[:3]]).astype(np.float32)
        out[name] = arr.reshape(t["shape"])
    return out


def load_hf_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a HF checkpoint dir (single file or sharded with an index), as float32."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(_load_file_any_dtype(f))
    return weights


def shard_rank(weights: dict[str, np.ndarray], cfg: LlamaConfig, mapping: Mapping, tp_rank: int, pp_rank: int):
    """The tensors rank (tp_rank, pp_rank) holds; names stay global so a shard says which layers it has."""
    tp = mapping.tp_size
    hd = cfg.head_dim

    def rows(w: np.ndarray, unit: int) -> np.ndarray:
        n = w.shape[0] // tp
        assert n % unit == 0, (w.shape, unit)
        return w[tp_rank * n : (tp_rank + 1) * n]

    def cols(w: np.ndarray) -> np.ndarray:
        n = w.shape[1] // tp
        return w[:, tp_rank * n : (tp_rank + 1) * n]

    out: dict[str, np.ndarray] = {}
    stages = mapping.stage_layers(cfg.num_hidden_layers)
    if pp_rank == 0:
        out["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    for layer in stages[pp_rank]:
        p = f"model.layers.{layer}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = weights[p + name]
        for proj in ("q_proj", "k_proj", "v_proj"):
            for kind in ("weight", "bias"):
                key = f"{p}self_attn.{proj}.{kind}"
                if key in weights:
                    out[key] = rows(weights[key], hd)
        out[p + "self_attn.o_proj.weight"] = cols(weights[p + "self_attn.o_proj.weight"])
        for proj in ("gate_proj", "up_proj"):
            out[f"{p}mlp.{proj}.weight"] = rows(weights[f"{p}mlp.{proj}.weight"], 1)
        out[p + "mlp.down_proj.weight"] = cols(weights[p + "mlp.down_proj.weight"])
        # Row-parallel biases are added once, after the all-reduce: TP rank 0 carries them.
        for key in (p + "self_attn.o_proj.bias", p + "mlp.down_proj.bias"):
            if key in weights and tp_rank == 0:
                out[key] = weights[key]
        for proj in ("gate_proj", "up_proj"):
            key = f"{p}mlp.{proj}.bias"
            if key in weights:
                out[key] = rows(weights[key], 1)
    if pp_rank == mapping.pp_size - 1:
        out["model.norm.weight"] = weights["model.norm.weight"]
        head = weights.get("lm_head.weight")
        out["lm_head.weight"] = weights["model.embed_tokens.weight"] if head is None else head
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_engine(engine_dir: str | Path, config: EngineConfig, weights: dict[str, np.ndarray], progress=None) -> list[Path]:
    """Writes `config.json` and one `rank{N}.safetensors` per rank into `engine_dir`."""
    engine_dir = Path(engine_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    mapping = config.mapping
    files = []
    for pp_rank in range(mapping.pp_size):
        for tp_rank in range(mapping.tp_size):
            rank = mapping.rank(tp_rank, pp_rank)
            path = engine_dir / f"rank{rank}.safetensors"
            shard = shard_rank(weights, config.model, mapping, tp_rank, pp_rank)
            save_file(shard, str(path), metadata={"rank": str(rank), "tp_rank": str(tp_rank), "pp_rank": str(pp_rank)})
            files.append(path)
            if progress is not None:
                progress(rank)
    (engine_dir / "config.json").write_text(config.to_json())
    return files


def read_rank(engine_dir: str | Path, rank: int) -> dict[str, np.ndarray]:
    return load_file(str(Path(engine_dir) / f"rank{rank}.safetensors"))
