"""Triton configs and launch scripts for the `tensorrtllm` backend (orchestrator mode, pre-spawned ranks).

One MPI world per node (per pool): rank 0 is the orchestrator (the tritonserver clients talk to), then each
role's instances in turn, TP x PP consecutive ranks each. Those ranks are the `participant_ids` of the
role's model config, next to the `gpu_device_ids` they drive, in the backend's syntax: `,` within an
instance, `;` between instances (instance i uses entry i). When roles run on different nodes, each node
gets its own script and world, the front end (orchestrator BLS and friends) runs with the first role's
pool, and reaches the other pools' models over gRPC. Model names are the repository renderer's
(`disagg.render`), so configs, directories and `--load-model` flags agree.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from disagg.render import ENGINE_MODELS, plan_models
from disagg.triton.contract import ENGINE_GRPC_PORT, ENGINE_URL_ENV
from disagg.spec import ROLES, DeploymentSpec, RoleSpec, SpecError
from disagg.trtllm import versions
from disagg.trtllm.commands import engine_dir, role_spec

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "tensorrtllm"
TRTLLM_KV_BACKENDS = ("ucx", "nixl", "mpi")
# The orchestrator cancels requests whose client went away; this bounds how long such a request keeps
# decoding (and holding KV blocks). Upstream's default is 100 ms.
CANCELLATION_CHECK_PERIOD_MS = 20
PORTS = {"http": 8000, "grpc": ENGINE_GRPC_PORT, "metrics": 8002}  # launch_triton_server.py's defaults
# UCX settings that put KV transfers on NVLink ("Set A" in TensorRT-LLM's disaggregated-serving docs).
NVLINK_ENV = (
    ("UCX_MEMTYPE_CACHE", "n"),
    ("UCX_RNDV_FRAG_MEM_TYPES", "cuda"),
    ("UCX_RNDV_PIPELINE_ERROR_HANDLING", "y"),
    ("TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE", "0B"),
)


@dataclass(frozen=True)
class Tensor:
    """One engine-model input or output, as in the tensorrtllm backend's config.pbtxt."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = True
    scalar: bool = False  # dims [1], reshaped to a per-request scalar
    ragged: bool = False


def _scalars(data_type: str, *names: str) -> tuple[Tensor, ...]:
    return tuple(Tensor(n, data_type, (1,), scalar=True) for n in names)


# The text-LLM subset of the backend's contract: everything the orchestrator sends or reads.
INPUTS = (
    Tensor("input_ids", "TYPE_INT32", (-1,), ragged=True),
    Tensor("input_lengths", "TYPE_INT32", (1,), optional=False, scalar=True),
    Tensor("request_output_len", "TYPE_INT32", (1,), optional=False, scalar=True),
    *_scalars("TYPE_INT32", "end_id", "pad_id", "runtime_top_k", "min_tokens"),
    *_scalars("TYPE_FP32", "temperature", "runtime_top_p", "len_penalty", "repetition_penalty",
              "presence_penalty", "frequency_penalty"),
    Tensor("stop_words_list", "TYPE_INT32", (2, -1), ragged=True),
    Tensor("bad_words_list", "TYPE_INT32", (2, -1), ragged=True),
    *_scalars("TYPE_UINT64", "seed"),
    *_scalars("TYPE_BOOL", "streaming", "stop", "return_log_probs", "return_perf_metrics",
              "exclude_input_in_output"),
    Tensor("context_phase_params", "TYPE_UINT8", (-1,), ragged=True),
)  # fmt: skip
OUTPUTS = (
    Tensor("output_ids", "TYPE_INT32", (-1, -1)),
    Tensor("sequence_length", "TYPE_INT32", (-1,)),
    Tensor("cum_log_probs", "TYPE_FP32", (-1,)),
    Tensor("output_log_probs", "TYPE_FP32", (-1, -1)),
    Tensor("context_phase_params", "TYPE_UINT8", (-1,)),
    *(Tensor(n, "TYPE_INT32", (1,)) for n in
      ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")),
    *(Tensor(n, "TYPE_INT64", (1,)) for n in
      ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")),
)  # fmt: skip


@dataclass(frozen=True)
class InstanceRanks:
    """The MPI ranks (participant ids) of one role instance, one per device, in TensorRT-LLM rank order."""

    role: str
    instance: int
    devices: tuple[int, ...]
    ranks: tuple[int, ...]


def _roles(spec: DeploymentSpec) -> list[RoleSpec]:
    return [spec.roles[name] for name in ROLES if name in spec.roles]


def nodes(spec: DeploymentSpec) -> list[str]:
    """Distinct nodes, first the one with the first role (prefill): it hosts the front end."""
    return list(dict.fromkeys(role.node for role in _roles(spec)))


def mpi_world(spec: DeploymentSpec, node: str) -> tuple[InstanceRanks, ...]:
    """Rank layout of one node's MPI world; rank 0 (the orchestrator) is implied."""
    layout, rank = [], 1
    for role in _roles(spec):
        if role.node != node:
            continue
        for i, devices in enumerate(role.devices):
            layout.append(InstanceRanks(role.name, i, devices, tuple(range(rank, rank + role.world_size))))
            rank += role.world_size
    return tuple(layout)


def check_spec(spec: DeploymentSpec) -> None:
    """What the tensorrtllm path needs beyond spec.py's checks; call it before any build starts."""
    if spec.backend != "tensorrt_llm":
        raise SpecError("backend", f"{spec.backend!r}: tensorrtllm configs are rendered only for backend tensorrt_llm")
    for role in _roles(spec):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", role.node):
            raise SpecError(f"roles.{role.name}.node", f"{role.node!r} is not a host name (letters, digits, '.', '_', '-')")
    if not spec.disaggregated:
        return
    kv = spec.kv_transfer.backend
    if kv not in TRTLLM_KV_BACKENDS:
        raise SpecError(
            "kv_transfer.backend",
            f"{kv!r} is a reference-engine transport; TensorRT-LLM's cache transceiver uses {', '.join(TRTLLM_KV_BACKENDS)}",
        )
    prefill, decode = spec.roles["prefill"], spec.roles["decode"]
    if prefill.tokens_per_block != decode.tokens_per_block:  # the block size travels in the CacheState
        raise SpecError(
            "roles.decode.tokens_per_block",
            f"{decode.tokens_per_block} differs from roles.prefill.tokens_per_block={prefill.tokens_per_block}: "
            "keep them equal: the handed-over KV layout carries the block size, and converting it is not documented",
        )
    if kv == "mpi" and len(nodes(spec)) > 1:
        raise SpecError(
            "kv_transfer.backend",
            f"'mpi' needs prefill and decode in one MPI world, but roles run on nodes {', '.join(nodes(spec))} "
            "(one world per pool): use ucx or nixl",
        )


def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _ids(groups: list[tuple[int, ...]]) -> str:
    return ";".join(",".join(map(str, group)) for group in groups)


def render_engine_config(spec: DeploymentSpec, role_name: str) -> str:
    """config.pbtxt of one role's model; decoupled by default for every role, prefill included: the
    orchestrator calls every engine slot with exec(decoupled=True), whichever backend fills it."""
    role = role_spec(spec, role_name)
    check_spec(spec)
    mine = [x for x in mpi_world(spec, role.node) if x.role == role_name]
    parameters = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine_dir(spec, role_name).absolute()),
        "batch_scheduler_policy": role.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(role.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": str(role.enable_kv_cache_reuse).lower(),
        "max_beam_width": "1",
        "gpu_device_ids": _ids([x.devices for x in mine]),
        "participant_ids": _ids([x.ranks for x in mine]),
        "exclude_input_in_output": "true",
        "cancellation_check_period_ms": str(CANCELLATION_CHECK_PERIOD_MS),
    }
    return _templates().get_template("config.pbtxt.j2").render(
        source=spec.source or spec.name,
        name=ENGINE_MODELS[role_name],
        role=role,
        decoupled=True,
        inputs=INPUTS,
        outputs=OUTPUTS,
        parameters=parameters,
    )


def _rank_argv(spec: DeploymentSpec, rank: int, load: list[str] | None) -> list[str]:
    """One tritonserver of the MPMD line, as launch_triton_server.py builds it; `load` None loads all."""
    argv = ["tritonserver", f"--model-repository={spec.model_repository.absolute()}"]
    argv += [f"--{kind}-port={port}" for kind, port in PORTS.items()]
    if load is not None:
        argv += ["--model-control-mode=explicit", *(f"--load-model={name}" for name in load)]
    return argv + ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]


def _environment_vars(spec: DeploymentSpec) -> list[tuple[str, str]]:
    env = [("TRTLLM_ORCHESTRATOR", "1"), ("TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES", "0")]
    # The disagg orchestrator reaches the engine models through this server's gRPC endpoint.
    env.append((ENGINE_URL_ENV, f"127.0.0.1:{PORTS['grpc']}"))
    if spec.disaggregated:
        env.append((f"TRTLLM_USE_{spec.kv_transfer.backend.upper()}_KVCACHE", "1"))
        if spec.kv_transfer.nvlink:
            env += NVLINK_ENV
    return env


def _models_here(spec: DeploymentSpec, node: str) -> list[str] | None:
    """What rank 0 on `node` loads: None (everything) on a single node; else this pool's engine models,
    plus, in the first pool, every model of the repository that is not another pool's engine."""
    all_nodes = nodes(spec)
    if len(all_nodes) == 1:
        return None
    elsewhere = {ENGINE_MODELS[r.name] for r in _roles(spec) if r.node != node}
    if node == all_nodes[0]:
        return [m.name for m in plan_models(spec) if m.name not in elsewhere]
    return [ENGINE_MODELS[r.name] for r in _roles(spec) if r.node == node]


def _connection(spec: DeploymentSpec, node: str) -> list[str]:
    all_nodes = nodes(spec)
    if len(all_nodes) == 1:
        return []
    front, grpc = all_nodes[0], PORTS["grpc"]
    if node == front:
        remote = [f"{ENGINE_MODELS[r.name]} at {r.node}:{grpc}" for r in _roles(spec) if r.node != front]
        lines = [f"Front-end pool: the orchestrator here reaches {', '.join(remote)} over gRPC; start those pools too."]
    else:
        lines = [f"The orchestrator on {front} calls this pool's models over gRPC at {node}:{grpc}."]
    return lines + [f"KV blocks move between pools over {spec.kv_transfer.backend.upper()} (TRTLLM_USE_*_KVCACHE)."]


def _launch_script(spec: DeploymentSpec, node: str) -> str:
    layout = mpi_world(spec, node)
    rank0_load = _models_here(spec, node)
    segments = [_rank_argv(spec, 0, rank0_load)]
    segments += [_rank_argv(spec, rank, [ENGINE_MODELS[x.role]]) for x in layout for rank in x.ranks]
    return _templates().get_template("launch.sh.j2").render(
        source=spec.source or spec.name,
        node=node,
        supported=versions.SUPPORTED_RANGE,
        image=versions.TARGET.image,
        world_size=len(segments),
        layout=layout,
        rank0_load=rank0_load,
        connection=_connection(spec, node),
        env=_environment_vars(spec),
        segments=[shlex.join(argv) for argv in segments],
    )


def render_launch_script(spec: DeploymentSpec) -> dict[str, str]:
    """File name -> bash script: `launch.sh` for one node, else `launch-<node>.sh` per node (pool)."""
    check_spec(spec)
    all_nodes = nodes(spec)
    if len(all_nodes) == 1:
        return {"launch.sh": _launch_script(spec, all_nodes[0])}
    return {f"launch-{node}.sh": _launch_script(spec, node) for node in all_nodes}
