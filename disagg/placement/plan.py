"""Placement plan: where each role instance runs, whether it fits, and how fast its TP group talks.

Checks that need no GPU (device counts, overlaps) always run; device ids, memory and links are checked
against the inventory of the node they run on, when there is one. The numbers are estimates, and the
plan says so: weights per GPU = parameters x dtype size / (TP x PP); KV capacity per instance =
kv_cache_free_gpu_mem_fraction x (GPU memory - weights) / KV bytes per token per GPU (TP splits the KV
heads, PP the layers). Activations and TensorRT workspace are not counted.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from disagg.placement.inventory import GpuInventory, link_rank, no_driver_reason
from disagg.spec import ROLES, DeploymentSpec, RoleSpec, SpecError, model_config_for

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelSize:
    params: int
    source: str  # where the parameter count comes from
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1, pp: int = 1) -> int:
        """K and V of one token on the most loaded GPU: KV heads split by TP, layers by PP."""
        return 2 * math.ceil(self.layers / pp) * (self.kv_heads // tp) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Placement:
    """One role instance."""

    role: str
    instance: int
    node: str
    devices: tuple[int, ...]  # empty: CPU (reference engine)
    tp: int
    pp: int
    weight_bytes_per_gpu: int
    kv_tokens: int | None  # None: needs the GPU inventory of its node
    link: str  # slowest link inside a TP group
    numa: str


@dataclass(frozen=True)
class Plan:
    name: str
    backend: str
    model: ModelSize
    placements: tuple[Placement, ...]
    notes: tuple[str, ...]


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps one digit before the point."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _safetensors_params(model_dir: Path) -> tuple[int, str] | None:
    """Parameter count from the safetensors headers (8-byte length + JSON), without reading weights."""
    shards = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not shards:
        return None
    total = 0
    for shard in shards:
        try:
            with shard.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, struct.error, ValueError) as exc:
            raise SpecError("model.path", f"{shard} is not a readable safetensors file ({exc})") from exc
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total, f"safetensors headers of {len(shards)} file(s)"


def _config_params(config: dict) -> int:
    """Llama parameter count from config.json: embeddings, attention, SwiGLU MLP, norms, LM head."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    mlp = 3 * hidden * config["intermediate_size"]  # gate, up, down
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp + 2 * hidden) + hidden + embeddings


def model_size(spec: DeploymentSpec) -> ModelSize:
    config = model_config_for(spec)
    heads = config["num_attention_heads"]
    counted = _safetensors_params(spec.model.path)
    params, source = counted or (_config_params(config), "config.json (no *.safetensors found)")
    return ModelSize(
        params=params,
        source=source,
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        dtype=spec.model.dtype,
    )


def _roles(spec: DeploymentSpec) -> list[RoleSpec]:
    return [spec.roles[name] for name in ROLES if name in spec.roles]


def _check_devices(spec: DeploymentSpec) -> None:
    """Device lists: one per instance, TP x PP long, no GPU used twice on a node."""
    owner: dict[tuple[str, int], str] = {}
    for role in _roles(spec):
        at = f"roles.{role.name}.devices"
        if not role.devices:
            if spec.backend == "tensorrt_llm":
                raise SpecError(at, "required with backend tensorrt_llm (one list of GPU ids per instance)")
            continue
        if len(role.devices) != role.instances:
            raise SpecError(at, f"{len(role.devices)} device lists for instances={role.instances}")
        for i, devices in enumerate(role.devices):
            if len(devices) != role.world_size:
                raise SpecError(
                    f"{at}.{i}",
                    f"{len(devices)} devices {list(devices)} but tp*pp = {role.tp}*{role.pp} = {role.world_size}",
                )
            for dev in devices:
                key = (role.node, dev)
                if key in owner:
                    raise SpecError(f"{at}.{i}", f"GPU {dev} on node {role.node!r} is already used by {owner[key]}")
                owner[key] = f"{at}.{i}"


def _checked_nodes(spec: DeploymentSpec, inv: GpuInventory | None) -> set[str]:
    """Nodes the inventory describes: this host (or "localhost"), or the only node of the spec."""
    if inv is None:
        return set()
    all_nodes = {role.node for role in spec.roles.values()}
    return all_nodes if len(all_nodes) == 1 else all_nodes & {"localhost", inv.hostname}


def _place_on_gpus(role: RoleSpec, i: int, model: ModelSize, inv: GpuInventory | None) -> Placement:
    devices = role.devices[i]
    weights = math.ceil(model.weight_bytes / role.world_size)
    if inv is None:
        return Placement(role.name, i, role.node, devices, role.tp, role.pp, weights, None, "?", "?")
    for dev in devices:
        if not inv.has(dev):
            raise SpecError(
                f"roles.{role.name}.devices.{i}",
                f"GPU {dev} is not on {inv.hostname} (it has GPUs 0-{len(inv.gpus) - 1})",
            )
    per_token = model.kv_bytes_per_token(role.tp, role.pp)
    frac = role.kv_cache_free_gpu_mem_fraction
    tokens = []
    for dev in devices:
        gpu = inv.gpus[dev]
        free = max(0.0, frac * (gpu.memory_bytes - weights))
        fits = int(free // per_token)
        if fits < role.max_seq_len:
            raise SpecError(
                f"roles.{role.name}",
                f"weights need {weights / GIB:.1f} GiB per GPU but GPU {dev} ({gpu.name}, "
                f"{gpu.memory_bytes / GIB:.1f} GiB) leaves {free / GIB:.1f} GiB for the KV cache "
                f"(kv_cache_free_gpu_mem_fraction {frac} x what the weights leave): {fits} tokens of "
                f"{size_text(per_token)}, less than one sequence of max_seq_len={role.max_seq_len}",
            )
        tokens.append(fits)
    groups = [devices[s : s + role.tp] for s in range(0, len(devices), role.tp)]
    link = inv.link_name(max(groups, key=lambda g: link_rank(inv.link_code(g))))
    numa = ",".join(sorted({str(inv.gpus[d].numa_node) for d in devices}))
    return Placement(role.name, i, role.node, devices, role.tp, role.pp, weights, min(tokens), link, numa)


def make_plan(spec: DeploymentSpec, inv: GpuInventory | None) -> Plan:
    """Places every role instance; raises SpecError (key path and numbers) when something cannot work."""
    model = model_size(spec)
    _check_devices(spec)
    checked = _checked_nodes(spec, inv)
    placements = []
    for role in _roles(spec):
        for i in range(role.instances):
            if spec.backend == "tensorrt_llm":
                placements.append(_place_on_gpus(role, i, model, inv if role.node in checked else None))
            else:  # the reference engine: shards in one CPU process, a fixed block pool
                weights = math.ceil(model.weight_bytes / role.world_size)
                tokens = role.kv_cache_blocks * role.tokens_per_block
                placements.append(Placement(role.name, i, role.node, (), role.tp, role.pp, weights, tokens, "in-process", "-"))
    return Plan(spec.name, spec.backend, model, tuple(placements), _notes(spec, inv, checked, model))


def _notes(spec: DeploymentSpec, inv: GpuInventory | None, checked: set[str], model: ModelSize) -> tuple[str, ...]:
    notes = []
    if spec.backend == "reference":
        notes.append("reference engine: runs on CPU; KV capacity is kv_cache_blocks x tokens_per_block")
    elif inv is None:
        reason = no_driver_reason() or "no GPU inventory given"
        notes.append(f"{reason}: device ids, GPU memory, KV capacity and links not checked (spec checks passed)")
    else:
        names = sorted({f"{g.name} ({g.memory_bytes / GIB:.1f} GiB)" for g in inv.gpus})
        notes.append(f"GPUs on {inv.hostname}: {len(inv.gpus)} x {', '.join(names)}, driver {inv.driver_version}")
        for node in sorted({r.node for r in spec.roles.values()} - checked):
            notes.append(f"node {node!r} is not this machine ({inv.hostname}): plan there to check its GPUs")
    notes.append(
        f"weights: {model.params:,} parameters from {model.source} x {model.dtype} = "
        f"{size_text(model.weight_bytes)}, split evenly over TP x PP (estimate)"
    )
    if spec.backend == "tensorrt_llm":
        notes.append(
            f"KV cache: {size_text(model.kv_bytes_per_token())} per token (K+V x {model.layers} layers x "
            f"{model.kv_heads} KV heads x {model.head_dim} x {model.dtype}), split over TP (heads) x PP (layers); "
            "capacity = kv_cache_free_gpu_mem_fraction x (GPU memory - weights), activations not counted"
        )
    return tuple(notes)


def format_plan(plan: Plan) -> str:
    """The plan as a text table plus its notes."""
    header = ("role", "inst", "node", "devices", "TP x PP", "weights/GPU", "KV tokens/inst", "TP link", "NUMA")
    rows = [
        (
            p.role,
            str(p.instance),
            p.node,
            ",".join(map(str, p.devices)) or "cpu",
            f"{p.tp} x {p.pp}",
            size_text(p.weight_bytes_per_gpu),
            "?" if p.kv_tokens is None else f"{p.kv_tokens:,}",
            p.link,
            p.numa,
        )
        for p in plan.placements
    ]
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
    lines = [f"placement plan for {plan.name} (backend {plan.backend})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines) + "\n"
