"""Step times of a TensorRT-LLM engine on GPUs, estimated from the GPU's datasheet: for planning where the
engines cannot be profiled (no GPU at hand, or before building them).

An estimate, not a measurement: each rate below is a datasheet peak times an efficiency stated here. A step
of a TP group reads its shard of the weights once and the KV its sequences attend to, computes 2 FLOPs per
weight per new token and 4 x layers x heads x head_dim per attended (query, key) pair (QK^T and PV), all-
reduces twice per layer across the group, and pays a fixed host cost (scheduling, sampling, launches). A
decode step takes the longer of reading its weights and computing its matmuls (a few sequences are bound by
the reads); a step with prompt tokens pays both, since a line in its tokens has no "longer of" (a 2048-token
chunk of Llama-3.1-8B comes out about 8% slow, a whole prompt of thousands about 2%). The LM head computes
every decoding sequence's logits but only a prompt's last token's, as TensorRT-LLM does without
gather_context_logits. Pipeline parallelism is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

from disagg.planner.profile import DecodeTable, Linear, StepModel


@dataclass(frozen=True)
class Accelerator:
    """One GPU's datasheet figures (SXM parts, dense 16-bit tensor-core peak); memory as NVML reports it."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    dense_flops: float
    nvlink_bytes_per_s: float  # per direction


GIB = 1024**3
ACCELERATORS = {
    "H200": Accelerator("H200 SXM", 140.4 * GIB, 4.8e12, 989e12, 450e9),
    "H100": Accelerator("H100 SXM", 79.6 * GIB, 3.35e12, 989e12, 450e9),
    "A100": Accelerator("A100 SXM 80GB", 80.0 * GIB, 2.039e12, 312e12, 300e9),
}
MEMORY_EFFICIENCY = 0.8  # of the HBM peak a streaming kernel sustains
GEMM_EFFICIENCY = 0.65  # of the tensor-core peak for a prompt's large matmuls
ATTENTION_EFFICIENCY = 0.5  # of the tensor-core peak for fused attention
ALLREDUCE_LATENCY_S = 8e-6  # one small all-reduce inside an NVSwitch node
STEP_OVERHEAD_S = 0.5e-3  # the host's share of a step: scheduling, sampling, kernel launches
HANDOFF_LATENCY_S = 1e-3  # a KV transfer's setup
HANDOFF_NVLINK_EFFICIENCY = 0.5  # of NVLink's peak through the cache transceiver
NIC_BYTES_PER_S = 40e9  # one 400 Gb/s RDMA NIC per GPU, at 80%
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # up to the spec's largest max_batch_size


@dataclass(frozen=True)
class ModelShape:
    """What a step's cost depends on, from the checkpoint's config.json (Llama layout)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    tied_embeddings: bool

    @classmethod
    def of(cls, config: dict, dtype_bytes: int) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config["hidden_size"], heads, config.get("num_key_value_heads", heads),
                   config.get("head_dim") or config["hidden_size"] // heads, config["intermediate_size"],
                   config["vocab_size"], dtype_bytes, bool(config.get("tie_word_embeddings")))

    @property
    def layer_weights(self) -> int:
        """Weights every new token multiplies in the layers: attention and MLP."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def matmul_weights(self) -> int:
        """Weights a token whose logits are computed multiplies: the layers' and the LM head (the input
        embedding is a lookup)."""
        return self.layer_weights + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.matmul_weights + embedding) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.layers * self.heads * self.head_dim


def steps(model: ModelShape, tp: int, gpu: Accelerator) -> StepModel:
    """The StepModel of one TP group of `gpu`s serving `model`."""
    hbm = gpu.hbm_bytes_per_s * MEMORY_EFFICIENCY
    gemm = gpu.dense_flops * GEMM_EFFICIENCY
    weights_s = model.matmul_weights * model.dtype_bytes / tp / hbm
    flops_s_per_token = 2 * model.matmul_weights / tp / gemm
    head_s = 2 * model.vocab * model.hidden / tp / gemm  # one sequence's logits
    reduce_latency_s = 2 * model.layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0
    reduce_s_per_token = 2 * model.layers * 2 * (tp - 1) / tp * model.hidden * model.dtype_bytes / gpu.nvlink_bytes_per_s
    attended_s = (model.kv_bytes_per_token / tp / hbm
                  + model.attention_flops_per_pair / tp / (gpu.dense_flops * ATTENTION_EFFICIENCY))
    base = tuple(STEP_OVERHEAD_S + reduce_latency_s + max(weights_s, flops_s_per_token * b) + reduce_s_per_token * b
                 for b in DECODE_BATCHES)
    decode = DecodeTable(DECODE_BATCHES, base, (attended_s,) * len(DECODE_BATCHES))
    prompt = Linear(STEP_OVERHEAD_S + reduce_latency_s + weights_s + head_s, flops_s_per_token - head_s + reduce_s_per_token,
                    model.attention_flops_per_pair / tp / (gpu.dense_flops * ATTENTION_EFFICIENCY))
    return StepModel(decode, prompt, fit_error=0.0)


def kv_capacity_tokens(model: ModelShape, tp: int, gpu: Accelerator, free_fraction: float) -> int:
    """Tokens of KV one TP group holds: `free_fraction` of what its weights leave free (as
    kv_cache_free_gpu_mem_fraction sizes TensorRT-LLM's pool; activations not counted)."""
    free = gpu.memory_bytes - model.weight_bytes / tp
    return int(free_fraction * free * tp / model.kv_bytes_per_token) if free > 0 else 0


def handoff(model: ModelShape, prefill_tp: int, decode_tp: int, gpu: Accelerator, nvlink: bool):
    """Seconds to move a prompt's KV from a prefill group to a decode group, over NVLink inside a node or over
    one RDMA NIC per GPU across nodes, as many links at once as the narrower group has GPUs."""
    link = (gpu.nvlink_bytes_per_s * HANDOFF_NVLINK_EFFICIENCY if nvlink else NIC_BYTES_PER_S) * min(prefill_tp, decode_tp)
    return lambda tokens: HANDOFF_LATENCY_S + tokens * model.kv_bytes_per_token / link
