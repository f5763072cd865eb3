"""Deployment spec: one YAML file describes the model, the roles and how KV moves between them.

Validation happens in two passes, both before any work starts:
1. the JSON schema (types, ranges, unknown keys), and
2. cross-field checks against the model's `config.json` (TP divides the KV heads, limits fit the
   model's context, roles do not share devices).
Every failure is a `SpecError` whose message starts with the dotted key path, e.g.
`roles.decode.tp: 3 does not divide num_key_value_heads=4`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml

from disagg.engine.config import engine_max_input_len

ROLES = ("prefill", "decode", "aggregated")
BACKENDS = ("reference", "tensorrt_llm")
KV_TRANSFER_BACKENDS = ("shm", "tcp", "ucx", "nixl", "mpi")
PREFILL_ROUTING = ("cache_aware", "least_loaded", "random")
POOL_ROUTING = ("service_class", "least_loaded", "round_robin")
DTYPES = ("float32", "float16", "bfloat16")
# GPU classes a pool can run on, with their CUDA compute capability: a TensorRT engine runs only on the
# architecture it was built on, so each role is built on its pool's class.
HARDWARE = {
    "a100": "sm80", "h100": "sm90", "h200": "sm90", "h20": "sm90", "gh200": "sm90",
    "l4": "sm89", "l40s": "sm89", "b200": "sm100", "gb200": "sm100",
}
FRONT_SERVICE_TYPES = ("ClusterIP", "LoadBalancer", "NodePort")
_DNS_LABEL = "^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"  # Kubernetes object names (RFC 1035 labels)
# A pool names a StatefulSet, whose pods carry a controller-revision-hash label of name + 11 characters.
_POOL_NAME = "^[a-z]([-a-z0-9]{0,50}[a-z0-9])?$"
_QUANTITY = "^[0-9]+(\\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$"


class SpecError(ValueError):
    """A deployment spec is invalid; `path` is the dotted key path the message starts with."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


_ROLE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["max_batch_size", "max_input_len", "max_seq_len"],
    "properties": {
        "tp": {"type": "integer", "minimum": 1, "maximum": 64},
        "pp": {"type": "integer", "minimum": 1, "maximum": 64},
        "instances": {"type": "integer", "minimum": 1, "maximum": 64},
        "node": {"type": "string", "minLength": 1},
        "devices": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        },
        "max_batch_size": {"type": "integer", "minimum": 1, "maximum": 4096},
        "max_input_len": {"type": "integer", "minimum": 1},
        "max_seq_len": {"type": "integer", "minimum": 2},
        "max_num_tokens": {"type": "integer", "minimum": 1},
        "tokens_per_block": {"type": "integer", "minimum": 1, "maximum": 1024},
        "kv_cache_blocks": {"type": "integer", "minimum": 1},
        "kv_cache_free_gpu_mem_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "enable_kv_cache_reuse": {"type": "boolean"},
        "kv_store_mb": {"type": "integer", "minimum": 0},
        "kv_store_disk_mb": {"type": "integer", "minimum": 0},
        "kv_store_disk_dir": {"type": "string", "minLength": 1},
        "enable_chunked_context": {"type": "boolean"},
        "batch_scheduler_policy": {"enum": ["max_utilization", "guaranteed_no_evict"]},
    },
}

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "backend", "model", "roles"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "backend": {"enum": list(BACKENDS)},
        "trtllm_release": {"type": "string", "minLength": 1},
        "model": {
            "type": "object",
            "additionalProperties": False,
            "required": ["path"],
            "properties": {
                "path": {"type": "string", "minLength": 1},
                "dtype": {"enum": list(DTYPES)},
                "add_special_tokens": {"type": "boolean"},
                "generate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["preset"],
                    "properties": {
                        "preset": {"type": "string"},
                        "seed": {"type": "integer", "minimum": 0},
                    },
                },
            },
        },
        "roles": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {role: _ROLE_SCHEMA for role in ROLES},
        },
        "kv_transfer": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "backend": {"enum": list(KV_TRANSFER_BACKENDS)},
                "lease_seconds": {"type": "number", "exclusiveMinimum": 0},
                "bind_address": {"type": "string"},
                "nvlink": {"type": "boolean"},
            },
        },
        "orchestrator": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "instances": {"type": "integer", "minimum": 1},
                "max_in_flight": {"type": "integer", "minimum": 1},
                "prefill_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "decode_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "prefill_routing": {"enum": list(PREFILL_ROUTING)},
                "pool_routing": {"enum": list(POOL_ROUTING)},
                "coalesce_backlog": {"type": "integer", "minimum": 0},
                "bls": {"type": "boolean"},
                "service_classes": {
                    "type": "object",
                    "minProperties": 1,
                    "propertyNames": {"pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
                    "additionalProperties": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "ttft_ms": {"type": "number", "exclusiveMinimum": 0},
                            "tpot_ms": {"type": "number", "exclusiveMinimum": 0},
                        },
                    },
                },
                "default_service_class": {"type": "string", "minLength": 1},
            },
        },
        "pools": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": _POOL_NAME},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["roles", "hardware"],
                "properties": {
                    "roles": {"type": "array", "items": {"enum": list(ROLES)}, "minItems": 1, "uniqueItems": True},
                    "hardware": {"enum": list(HARDWARE)},
                    "replicas": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "cost": {"type": "number", "exclusiveMinimum": 0},
                    "node_selector": {"type": "object", "additionalProperties": {"type": "string"}},
                    "cpu": {"type": "string", "pattern": _QUANTITY},
                    "memory": {"type": "string", "pattern": _QUANTITY},
                },
            },
        },
        "kubernetes": {
            "type": "object",
            "additionalProperties": False,
            "required": ["namespace", "image", "engines_claim", "model_claim"],
            "properties": {
                "namespace": {"type": "string", "pattern": _DNS_LABEL},
                "image": {"type": "string", "minLength": 1},
                "engines_claim": {"type": "string", "pattern": _DNS_LABEL},
                "model_claim": {"type": "string", "pattern": _DNS_LABEL},
                "gpu_resource": {"type": "string", "minLength": 1},
                "host_network": {"type": "boolean"},
                "front": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "replicas": {"type": "integer", "minimum": 1, "maximum": 1000},
                        "service_type": {"enum": list(FRONT_SERVICE_TYPES)},
                        "cpu": {"type": "string", "pattern": _QUANTITY},
                        "memory": {"type": "string", "pattern": _QUANTITY},
                    },
                },
            },
        },
        "output": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "build_dir": {"type": "string", "minLength": 1},
                "model_repository": {"type": "string", "minLength": 1},
                "engine_root": {"type": "string", "minLength": 1},
            },
        },
    },
}


@dataclass(frozen=True)
class RoleSpec:
    """Limits and sharding of one role; the engine for it is built to exactly these numbers."""

    name: str
    tp: int
    pp: int
    instances: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_blocks: int
    devices: tuple[tuple[int, ...], ...] = ()
    node: str = "localhost"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = False
    # The node's prefix-block store this role's instances share (disagg.engine.kv_store); 0: none.
    kv_store_mb: int = 0
    # A tier on disk below it (for capacity), in a directory per model weights; it outlives the deployment.
    kv_store_disk_mb: int = 0
    kv_store_disk_dir: Path = Path("build/kv-store")
    enable_chunked_context: bool = False
    batch_scheduler_policy: str = "guaranteed_no_evict"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def engine_max_input_len(self) -> int:
        """The longest prompt the role's engine accepts, generation-only requests included."""
        return engine_max_input_len(self.max_seq_len, self.max_num_tokens, self.enable_chunked_context)

    @property
    def max_output_len(self) -> int:
        """Most new tokens a request may ask for: the sequence must still fit after a 1-token prompt."""
        return self.max_seq_len - 1


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    dtype: str = "float32"
    generate_preset: str | None = None
    generate_seed: int = 0
    # Preprocessing runs the tokenizer's post-processor (BOS etc. as the checkpoint's tokenizer.json
    # defines), like upstream's preprocessing parameter of the same name; false: the prompt's tokens only.
    add_special_tokens: bool = True
    # Not from the spec: a config.json given where the checkpoint is not at hand (`load_spec`'s model_config), whose
    # shape the spec is checked and planned against.
    config_file: Path | None = None


@dataclass(frozen=True)
class KVTransferSpec:
    backend: str = "shm"
    lease_seconds: float = 30.0
    bind_address: str = "127.0.0.1"
    nvlink: bool = True


@dataclass(frozen=True)
class OrchestratorSpec:
    instances: int = 1
    max_in_flight: int = 64
    prefill_timeout_s: float = 30.0
    decode_timeout_s: float = 300.0
    # Which prefill instance a request goes to: where its prefix is cached weighed against load (falls
    # back to load alone without enable_kv_cache_reuse), the least loaded, or at random (a baseline).
    prefill_routing: str = "cache_aware"
    # Token responses waiting behind a request's response that Triton has not sent yet (its client takes
    # them slower than the engine makes them) before the waiting tokens go out as one response; 0: never,
    # one token per response as the tensorrtllm backend streams (clients such as perf_analyzer count responses).
    coalesce_backlog: int = 0
    # Also render `tensorrt_llm_bls`: the ensemble's text contract served by one Python model that
    # tokenizes, orchestrates and detokenizes in process (each token crosses one Python process, not three).
    bls: bool = False
    # Classes of traffic, each with the TTFT and TPOT it must get (none: throughput only), and the class of
    # a request that names none; disagg.triton.sla routes each request to a pool that meets its class.
    service_classes: tuple[tuple[str, float | None, float | None], ...] = ()  # (name, ttft_ms, tpot_ms)
    default_service_class: str = ""
    # How a request with a class picks among the replicas of an engine model's pools: by its class
    # (disagg.triton.sla), or ignoring it, the least loaded or in turn (baselines for `bench sla`).
    pool_routing: str = "service_class"


@dataclass(frozen=True)
class PoolSpec:
    """Replicas of one pod that serves some roles' engines on one class of hardware. Each replica runs the
    roles' instances with their own devices (numbered inside the pod) in one MPI world; pools scale apart.
    Roles may be served by several pools of one architecture (a fast and a cheap one): each pool has the
    same roles, and `cost` weighs a hop there for service-class routing (disagg.triton.sla)."""

    name: str
    roles: tuple[str, ...]
    hardware: str
    replicas: int = 1
    cost: float = 1.0
    node_selector: tuple[tuple[str, str], ...] = ()
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class FrontSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"  # the only Service of the deployment that may be reached from outside
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class KubernetesSpec:
    namespace: str
    image: str  # one image for every pod: the release's NGC image with this package installed
    engines_claim: str  # PersistentVolumeClaim holding the built engines, one directory per role
    model_claim: str  # PersistentVolumeClaim holding the checkpoint (tokenizer), mounted at model.path
    gpu_resource: str = "nvidia.com/gpu"
    host_network: bool = False
    front: FrontSpec = field(default_factory=FrontSpec)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    backend: str
    model: ModelSpec
    roles: dict[str, RoleSpec]
    kv_transfer: KVTransferSpec = field(default_factory=KVTransferSpec)
    orchestrator: OrchestratorSpec = field(default_factory=OrchestratorSpec)
    build_dir: Path = Path("build")
    model_repository: Path = Path("model_repository")
    engine_root: Path | None = None  # where the serving host sees build_dir/engines, when not here
    trtllm_release: str | None = None  # backend tensorrt_llm: the TensorRT-LLM release line served
    pools: dict[str, PoolSpec] = field(default_factory=dict)  # empty: roles placed by their `node`
    kubernetes: KubernetesSpec | None = None
    source: Path | None = None

    def pools_of(self, role: str) -> list[PoolSpec]:
        """The pools that serve `role`, its node's first."""
        return [p for p in self.pools.values() if role in p.roles]

    def engine_dir(self, role: str) -> Path:
        """Where this machine builds the role's engine."""
        return self.build_dir / "engines" / role

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.roles and "decode" in self.roles


def _error_path(err: jsonschema.ValidationError) -> tuple[str, str]:
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        allowed = ", ".join(sorted(err.schema.get("properties", {})))
        key = f"{path}.{extra[0]}" if path else extra[0]
        return key, f"unknown key (allowed here: {allowed})"
    if err.validator == "required":
        missing = err.message.split("'")[1]
        return (f"{path}.{missing}" if path else missing), "required key is missing"
    return path, err.message


def _check_schema(raw: object) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.absolute_path), e.message))
    if errors:
        raise SpecError(*_error_path(errors[0]))


def _role_from_raw(name: str, raw: dict) -> RoleSpec:
    tokens_per_block = raw.get("tokens_per_block", 16)
    max_batch_size = raw["max_batch_size"]
    default_blocks = max_batch_size * -(-raw["max_seq_len"] // tokens_per_block)
    return RoleSpec(
        name=name,
        tp=raw.get("tp", 1),
        pp=raw.get("pp", 1),
        instances=raw.get("instances", 1),
        max_batch_size=max_batch_size,
        max_input_len=raw["max_input_len"],
        max_seq_len=raw["max_seq_len"],
        max_num_tokens=raw.get("max_num_tokens", max(raw["max_input_len"], max_batch_size)),
        tokens_per_block=tokens_per_block,
        kv_cache_blocks=raw.get("kv_cache_blocks", default_blocks),
        devices=tuple(tuple(d) for d in raw.get("devices", ())),
        node=raw.get("node", "localhost"),
        kv_cache_free_gpu_mem_fraction=raw.get("kv_cache_free_gpu_mem_fraction", 0.9),
        enable_kv_cache_reuse=raw.get("enable_kv_cache_reuse", False),
        kv_store_mb=raw.get("kv_store_mb", 0),
        kv_store_disk_mb=raw.get("kv_store_disk_mb", 0),
        kv_store_disk_dir=Path(raw.get("kv_store_disk_dir", "build/kv-store")),
        enable_chunked_context=raw.get("enable_chunked_context", False),
        batch_scheduler_policy=raw.get("batch_scheduler_policy", "guaranteed_no_evict"),
    )


def _check_role(role: RoleSpec, backend: str) -> None:
    at = f"roles.{role.name}"
    tpb = role.tokens_per_block
    if tpb & (tpb - 1):
        raise SpecError(f"{at}.tokens_per_block", f"{tpb} is not a power of 2")
    if role.max_input_len >= role.max_seq_len:
        raise SpecError(
            f"{at}.max_input_len",
            f"{role.max_input_len} must be below max_seq_len={role.max_seq_len} (room for at least one output token)",
        )
    if role.max_input_len > role.engine_max_input_len:
        # TensorRT-LLM checks generation-only requests against this limit too: decode is not exempt.
        raise SpecError(
            f"{at}.max_num_tokens",
            f"{role.max_num_tokens} is below max_input_len={role.max_input_len}: without chunked context the engine "
            "refuses every prompt (generation-only included) longer than min(max_seq_len - 1, max_num_tokens); "
            f"set {at}.enable_chunked_context: true or raise max_num_tokens",
        )
    per_seq = -(-role.max_seq_len // tpb)
    if role.kv_cache_blocks < per_seq:
        raise SpecError(
            f"{at}.kv_cache_blocks",
            f"{role.kv_cache_blocks} blocks of {tpb} tokens cannot hold one sequence of max_seq_len={role.max_seq_len} (needs {per_seq})",
        )
    if role.kv_store_mb and not role.enable_kv_cache_reuse:
        raise SpecError(f"{at}.kv_store_mb", "a prefix store needs enable_kv_cache_reuse: true on the role")
    if role.kv_store_disk_mb and not role.kv_store_mb:
        raise SpecError(f"{at}.kv_store_disk_mb", "a disk tier goes below the host-memory store: set kv_store_mb too")
    if role.kv_store_disk_mb and backend == "tensorrt_llm":
        raise SpecError(
            f"{at}.kv_store_disk_mb",
            "the tensorrtllm backend has no disk tier; kv_store_mb alone gives each instance a host-memory tier "
            "(kv_cache_host_memory_bytes)",
        )
    if backend == "tensorrt_llm" and not role.devices:
        raise SpecError(f"{at}.devices", "required with backend tensorrt_llm (one list of GPU ids per instance)")
    if role.devices:
        if len(role.devices) != role.instances:
            raise SpecError(f"{at}.devices", f"{len(role.devices)} device lists for instances={role.instances}")
        for i, devs in enumerate(role.devices):
            if len(devs) != role.world_size:
                raise SpecError(
                    f"{at}.devices.{i}",
                    f"{len(devs)} devices {list(devs)} but tp*pp = {role.tp}*{role.pp} = {role.world_size}",
                )
            if len(set(devs)) != len(devs):
                raise SpecError(f"{at}.devices.{i}", f"device listed twice in {list(devs)}")


def check_against_model(spec: DeploymentSpec, model_config: dict) -> None:
    """Cross-checks that need the model's `config.json` (a dict in Hugging Face's Llama format)."""
    kv_heads = model_config.get("num_key_value_heads", model_config["num_attention_heads"])
    heads = model_config["num_attention_heads"]
    layers = model_config["num_hidden_layers"]
    inter = model_config["intermediate_size"]
    max_pos = model_config.get("max_position_embeddings")
    for role in spec.roles.values():
        at = f"roles.{role.name}"
        if kv_heads % role.tp:
            raise SpecError(f"{at}.tp", f"{role.tp} does not divide num_key_value_heads={kv_heads}")
        if heads % role.tp:
            raise SpecError(f"{at}.tp", f"{role.tp} does not divide num_attention_heads={heads}")
        if inter % role.tp:
            raise SpecError(f"{at}.tp", f"{role.tp} does not divide intermediate_size={inter}")
        if role.pp > layers:
            raise SpecError(f"{at}.pp", f"{role.pp} is more pipeline stages than num_hidden_layers={layers}")
        if max_pos is not None:
            if role.max_input_len > max_pos:
                raise SpecError(
                    f"{at}.max_input_len", f"{role.max_input_len} exceeds the model's max_position_embeddings={max_pos}"
                )
            if role.max_seq_len > max_pos:
                raise SpecError(
                    f"{at}.max_seq_len", f"{role.max_seq_len} exceeds the model's max_position_embeddings={max_pos}"
                )


def _check_cross_role(spec: DeploymentSpec) -> None:
    if ("prefill" in spec.roles) != ("decode" in spec.roles):
        missing = "decode" if "prefill" in spec.roles else "prefill"
        raise SpecError(f"roles.{missing}", "required: prefill and decode come as a pair")
    if spec.disaggregated:
        prefill, decode = spec.roles["prefill"], spec.roles["decode"]
        if decode.max_input_len < prefill.max_input_len:
            raise SpecError(
                "roles.decode.max_input_len",
                f"{decode.max_input_len} is below roles.prefill.max_input_len={prefill.max_input_len}: "
                "decode could not import every prompt prefill accepts",
            )
    owner: dict[tuple[str, int], str] = {}
    for role in spec.roles.values():
        for i, devs in enumerate(role.devices):
            for dev in devs:
                key = (role.node, dev)
                if key in owner and owner[key] != role.name:
                    raise SpecError(
                        f"roles.{role.name}.devices.{i}",
                        f"GPU {dev} on node {role.node!r} is already used by roles.{owner[key]}",
                    )
                owner[key] = role.name


def _orchestrator_from_raw(raw: dict) -> OrchestratorSpec:
    classes = tuple((name, c.get("ttft_ms"), c.get("tpot_ms")) for name, c in raw.get("service_classes", {}).items())
    default = raw.get("default_service_class", classes[0][0] if classes else "")
    if default and default not in [c[0] for c in classes]:
        raise SpecError("orchestrator.default_service_class", f"{default!r} is not one of orchestrator.service_classes "
                        f"({', '.join(c[0] for c in classes) or 'none defined'})")
    rest = {k: v for k, v in raw.items() if k not in ("service_classes", "default_service_class")}
    return OrchestratorSpec(**rest, service_classes=classes, default_service_class=default)


def _pools_from_raw(raw: dict) -> dict[str, PoolSpec]:
    return {
        name: PoolSpec(
            name=name, roles=tuple(p["roles"]), hardware=p["hardware"], replicas=p.get("replicas", 1), cost=p.get("cost", 1.0),
            node_selector=tuple(sorted(p.get("node_selector", {}).items())), cpu=p.get("cpu"), memory=p.get("memory"),
        )
        for name, p in raw.get("pools", {}).items()
    }


def _kubernetes_from_raw(raw: dict) -> KubernetesSpec | None:
    if "kubernetes" not in raw:
        return None
    k8s = dict(raw["kubernetes"])
    return KubernetesSpec(**{**k8s, "front": FrontSpec(**k8s.get("front", {}))})


def _check_pools(spec: DeploymentSpec, raw_roles: dict) -> None:
    """Every role in a pool, each pool's devices numbered as its pod sees them; pools that share a role
    have the same roles on one GPU architecture (they run one launch script and one set of engines). The
    first pool's name becomes its roles' `node` (disagg.trtllm.render: one MPI world each)."""
    if spec.backend != "tensorrt_llm":
        raise SpecError(
            "pools", f"for backend tensorrt_llm only (this spec's is {spec.backend!r}): reference engines are served "
            "on one host by disagg-serve, or on several through roles.<role>.node",
        )
    placed: dict[str, str] = {}
    for pool in spec.pools.values():
        if pool.name == "front":
            raise SpecError("pools.front", "'front' names the front end's Service: call the pool something else")
        for role in pool.roles:
            at = f"pools.{pool.name}.roles"
            if role not in spec.roles:
                raise SpecError(at, f"{role!r} is not a role of this spec (roles: {', '.join(spec.roles)})")
            if role in placed:
                first = spec.pools[placed[role]]
                if set(pool.roles) != set(first.roles):
                    raise SpecError(at, f"{role!r} is also served by pools.{first.name}, whose roles are {list(first.roles)}: "
                                        "pools that share a role serve the same roles (they run the same launch script)")
                if HARDWARE[pool.hardware] != HARDWARE[first.hardware]:
                    same = [h for h, sm in HARDWARE.items() if sm == HARDWARE[first.hardware]]
                    raise SpecError(f"pools.{pool.name}.hardware", (
                        f"{pool.hardware} is {HARDWARE[pool.hardware]}, but {role!r} is also served by pools.{first.name} on "
                        f"{first.hardware} ({HARDWARE[first.hardware]}); a TensorRT engine runs only on the architecture it was "
                        f"built on: give the pools of {role!r} one architecture ({', '.join(same)})"))
                continue
            if "node" in raw_roles[role]:
                raise SpecError(f"roles.{role}.node", f"set by pools.{pool.name}: with pools, a role's place is its pool")
            placed[role] = pool.name
        devices = sorted({d for r in pool.roles for devs in spec.roles[r].devices for d in devs})
        if devices and devices != list(range(len(devices))):
            raise SpecError(
                f"pools.{pool.name}", f"its roles use GPUs {devices}; a pod sees the GPUs it is given as 0..{len(devices) - 1}: "
                "number the roles' devices from 0 without gaps",
            )
    unplaced = [r for r in spec.roles if r not in placed]
    if unplaced:
        raise SpecError(f"roles.{unplaced[0]}", f"in no pool: with pools, every role needs one ({', '.join(spec.pools)})")


def _check_kubernetes(spec: DeploymentSpec) -> None:
    k8s = spec.kubernetes
    if not spec.pools:
        raise SpecError("kubernetes", "needs pools: the manifests run one StatefulSet per pool")
    if not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", spec.name):
        raise SpecError("name", f"{spec.name!r}: with kubernetes it labels every object (at most 63 characters, ending in a letter or digit)")
    if not spec.model.path.is_absolute():
        raise SpecError("model.path", f"{str(spec.model.path)!r} must be absolute with kubernetes: kubernetes.model_claim is mounted there")
    if k8s.host_network and spec.kv_transfer.backend not in ("ucx", "nixl"):
        raise SpecError(
            "kubernetes.host_network",
            f"KV moves over {spec.kv_transfer.backend!r}, which works on the pod network; host networking would put "
            "every port of the engines (which check no credential) on the node's own addresses",
        )


def parse_spec(raw: object, source: Path | None = None) -> DeploymentSpec:
    """Validates a parsed YAML document and returns the typed spec (no model checks)."""
    if not isinstance(raw, dict):
        raise SpecError("", "a deployment spec must be a YAML mapping")
    _check_schema(raw)
    model = raw["model"]
    gen = model.get("generate")
    roles = {name: _role_from_raw(name, r) for name, r in raw["roles"].items()}
    pools = _pools_from_raw(raw)
    for pool in reversed(pools.values()):  # the first pool of its roles is their node: one pod, one MPI world
        roles.update({r: dataclasses.replace(roles[r], node=pool.name) for r in pool.roles if r in roles})
    out = raw.get("output", {})
    spec = DeploymentSpec(
        name=raw["name"],
        backend=raw["backend"],
        trtllm_release=raw.get("trtllm_release"),
        model=ModelSpec(
            path=Path(model["path"]),
            dtype=model.get("dtype", "float32"),
            generate_preset=gen["preset"] if gen else None,
            generate_seed=gen.get("seed", 0) if gen else 0,
            add_special_tokens=model.get("add_special_tokens", True),
        ),
        roles=roles,
        kv_transfer=KVTransferSpec(**raw.get("kv_transfer", {})),
        orchestrator=_orchestrator_from_raw(raw.get("orchestrator", {})),
        build_dir=Path(out.get("build_dir", "build")),
        model_repository=Path(out.get("model_repository", "model_repository")),
        pools=pools,
        kubernetes=_kubernetes_from_raw(raw),
        source=source,
    )
    if spec.trtllm_release is not None and spec.backend != "tensorrt_llm":
        raise SpecError("trtllm_release", f"only for backend tensorrt_llm (this spec's backend is {spec.backend!r})")
    if "engine_root" in out:
        spec = with_engine_root(spec, out["engine_root"])
    for role in roles.values():
        _check_role(role, spec.backend)
    if pools:
        _check_pools(spec, raw["roles"])
    if spec.kubernetes is not None:
        _check_kubernetes(spec)
    _check_cross_role(spec)
    if spec.backend == "reference" and spec.model.dtype != "float32":
        raise SpecError("model.dtype", f"{spec.model.dtype!r}: the reference engine computes in float32 only")
    return spec


def with_engine_root(spec: DeploymentSpec, engine_root: str) -> DeploymentSpec:
    """The spec rendered for a serving host that sees the engines under `engine_root`."""
    if not Path(engine_root).is_absolute():
        raise SpecError("output.engine_root", f"{engine_root!r} must be an absolute path (as the serving host sees it)")
    return dataclasses.replace(spec, engine_root=Path(engine_root))


def model_config_for(spec: DeploymentSpec) -> dict:
    """The model's config.json: read from the checkpoint, or from the preset it will be generated from."""
    from disagg.checkpoint import PRESETS

    config_path = spec.model.config_file or spec.model.path / "config.json"
    if config_path.is_file():
        try:
            return json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise SpecError("--model-config" if spec.model.config_file else "model.path", f"{config_path} is not JSON: {exc}") from None
    if spec.model.generate_preset is None:
        raise SpecError("model.path", f"{spec.model.path} has no config.json and model.generate is not set")
    if spec.model.generate_preset not in PRESETS:
        raise SpecError(
            "model.generate.preset", f"unknown preset {spec.model.generate_preset!r} (known: {', '.join(PRESETS)})"
        )
    return PRESETS[spec.model.generate_preset].hf_config()


def load_spec(path: str | Path, model_config: Path | None = None) -> DeploymentSpec:
    """Reads, schema-checks and model-checks a spec file (against `model_config`, a config.json, where given: a
    checkpoint not at hand). Raises SpecError on the first problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError("", f"{path} is not valid YAML: {exc}") from exc
    except OSError as exc:
        raise SpecError("", f"cannot read {path}: {exc.strerror}") from exc
    spec = parse_spec(raw, source=path)
    if model_config is not None:
        if not model_config.is_file():
            raise SpecError("--model-config", f"{model_config} is not a file")
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, config_file=model_config))
    check_against_model(spec, model_config_for(spec))
    return spec
