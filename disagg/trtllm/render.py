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

import dataclasses
import re
import shlex
from dataclasses import dataclass

from disagg.repository import render_template, role_models
from disagg.triton.contract import ENGINE_GRPC_PORT, ENGINE_METRICS_PORT, ENGINE_URL_ENV
from disagg.spec import ROLES, DeploymentSpec, RoleSpec, SpecError
from disagg.trtllm import versions
from disagg.trtllm.commands import role_spec

TRTLLM_KV_BACKENDS = ("ucx", "nixl", "mpi")
# The orchestrator cancels requests whose client went away; this bounds how long such a request keeps
# decoding (and holding KV blocks). Upstream's default is 100 ms.
CANCELLATION_CHECK_PERIOD_MS = 20
PORTS = {"http": 8000, "grpc": ENGINE_GRPC_PORT, "metrics": ENGINE_METRICS_PORT}  # launch_triton_server.py's defaults
# The front node's engines' server (MPI rank 0) listens here, on loopback only: the tensorrtllm backend
# checks no credential, so outside clients must not reach its models (a context-only request holds KV).
PRIVATE_PORTS = {"http": 8010, "grpc": 8011, "metrics": 8012}
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


# The text-LLM subset of the backend's contract: everything the orchestrator sends or reads, under the
# newest names (see versions.RENAMED_INPUTS; `inputs` gives a release's).
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


def inputs(release: versions.Release) -> tuple[Tensor, ...]:
    """INPUTS as `release`'s backend names them."""
    return tuple(dataclasses.replace(t, name=release.input_name(t.name)) for t in INPUTS)


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
    release = versions.release_of(spec)
    kv = spec.kv_transfer.backend
    if kv not in TRTLLM_KV_BACKENDS:
        raise SpecError(
            "kv_transfer.backend",
            f"{kv!r} is a reference-engine transport; TensorRT-LLM's cache transceiver uses {', '.join(TRTLLM_KV_BACKENDS)}",
        )
    if kv not in release.kv_transports:
        others = [r.name for r in versions.RELEASES if kv in r.kv_transports]
        raise SpecError(
            "kv_transfer.backend",
            f"{kv!r} does not work with TensorRT-LLM {release.name} (trtllm_release): {_transports_why(release)}; "
            f"use {' or '.join(release.kv_transports)}"
            + (f", or a release that has {kv}: {', '.join(others)}" if others else ""),
        )
    prefill, decode = spec.roles["prefill"], spec.roles["decode"]
    if prefill.tokens_per_block != decode.tokens_per_block:  # the block size travels in the CacheState
        raise SpecError(
            "roles.decode.tokens_per_block",
            f"{decode.tokens_per_block} differs from roles.prefill.tokens_per_block={prefill.tokens_per_block}: "
            "keep them equal: the handed-over KV layout carries the block size, and converting it is not documented",
        )
    if kv == "mpi" and len(nodes(spec)) > 1:
        ucx = [r.name for r in versions.RELEASES if "ucx" in r.kv_transports]
        raise SpecError(
            "kv_transfer.backend",
            f"'mpi' needs prefill and decode in one MPI world, but roles run on {'pools' if spec.pools else 'nodes'} {', '.join(nodes(spec))} "
            "(one world per pool): "
            + ("use ucx" if "ucx" in release.kv_transports else
               f"TensorRT-LLM {release.name} has no other transport in Triton; set trtllm_release to {' or '.join(ucx)} "
               "and use ucx between the pools, or put both roles " + ("in one pool" if spec.pools else "on one node")),
        )
    both = [p for p in spec.pools.values() if {"prefill", "decode"} <= set(p.roles)]
    if kv == "mpi" and both and (both[0].replicas > 1 or len(both) > 1):
        at, what = (f"pools.{both[0].name}.replicas", f"{both[0].replicas}") if both[0].replicas > 1 else \
            (f"pools.{both[1].name}", f"a second pool of prefill and decode beside pools.{both[0].name}")
        raise SpecError(
            at, f"{what}: with 'mpi' KV stays inside one pod's MPI world, but the orchestrator may send a "
            "request's decode to another replica than its prefill: use one pool with replicas: 1, or put prefill and "
            "decode in pools of their own with ucx (TensorRT-LLM 0.19 or 0.20), which scale apart",
        )
    for role in _roles(spec):
        if role.enable_chunked_context and not release.chunked_context:
            raise SpecError(f"roles.{role.name}.enable_chunked_context", f"TensorRT-LLM {release.name}'s Triton backend has no chunked context")


def _transports_why(release: versions.Release) -> str:
    if not release.transport_from_env:
        return ("its Triton backend sets the MPI cache transceiver itself and ignores TRTLLM_USE_*_KVCACHE "
                "(TensorRT-LLM PR #5234)")
    return f"its cache transceiver has {', '.join(release.kv_transports)} only (UCX came in 0.19)"


def _ids(groups: list[tuple[int, ...]]) -> str:
    return ";".join(",".join(map(str, group)) for group in groups)


def gpt_model_path(spec: DeploymentSpec, role_name: str) -> str:
    """The role's engine directory as the serving host sees it: under `output.engine_root` (e.g. a container
    mount) when the spec names one, else where this machine builds it. The backend needs it to exist."""
    if spec.engine_root is not None:
        return str(spec.engine_root / role_name)
    return str(spec.engine_dir(role_name).absolute())


def model_name(spec: DeploymentSpec, x: InstanceRanks) -> str:
    """The engine model an instance serves: its own (see disagg.repository.role_models), or the aggregated one."""
    models = role_models(spec, x.role)
    return models[x.instance] if len(models) > 1 else models[0]


def render_engine_configs(spec: DeploymentSpec, role_name: str) -> dict[str, str]:
    """model name -> config.pbtxt of a role's engine models: one per prefill/decode instance, each with
    its own `gpu_device_ids` and `participant_ids` entry; one for all aggregated instances (`;` between
    them). Decoupled for every role, prefill included: the orchestrator streams from every engine slot."""
    role = role_spec(spec, role_name)
    check_spec(spec)
    models: dict[str, list[InstanceRanks]] = {}
    for x in mpi_world(spec, role.node):
        if x.role == role_name:
            models.setdefault(model_name(spec, x), []).append(x)
    return {name: _engine_config(spec, role, name, mine) for name, mine in models.items()}


def _engine_config(spec: DeploymentSpec, role: RoleSpec, name: str, mine: list[InstanceRanks]) -> str:
    parameters = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": gpt_model_path(spec, role.name),
        "batch_scheduler_policy": role.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(role.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": str(role.enable_kv_cache_reuse).lower(),
        "max_beam_width": "1",
        "gpu_device_ids": _ids([x.devices for x in mine]),
        "participant_ids": _ids([x.ranks for x in mine]),
        "enable_chunked_context": str(role.enable_chunked_context).lower(),
        "exclude_input_in_output": "true",
        "cancellation_check_period_ms": str(CANCELLATION_CHECK_PERIOD_MS),
    }
    if role.kv_store_mb:  # reusable blocks offloaded to host memory rather than evicted, per instance
        parameters["kv_cache_host_memory_bytes"] = str(role.kv_store_mb << 20)
    release = versions.release_of(spec)
    return render_template(
        "config.pbtxt.j2",
        source=spec.source or spec.name,
        name=name,
        role=role,
        release=release,
        instances=len(mine),
        decoupled=True,
        inputs=inputs(release),
        outputs=OUTPUTS,
        parameters=parameters,
    )


# The launch script finds the repository beside itself (launch/ sits next to it), so the pair can be
# copied to the serving host as they are; MODEL_REPOSITORY overrides it.
REPOSITORY_ARG = '--model-repository="$MODEL_REPOSITORY"'
# Every server with ports runs in explicit model-control mode, whose repository API loads a model from files
# sent with the request (a Python model.py runs what it is given), and the shared-memory, logging and trace
# APIs reach the pod's memory and files. They answer only requests carrying this header, whose value the
# launch script draws at random unless $TRITON_ADMIN_KEY gives one: nothing here needs them.
ADMIN_HEADER = "triton-admin-key"
RESTRICTED = "model-repository,shared-memory,logging,trace"
RESTRICT_ARGS = (f'--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}="$ADMIN_KEY" '
                 f'--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}="$ADMIN_KEY"')


def _server_argv(load: list[str], shm_prefix: str, ports: dict[str, int] | None, address: str | None = None) -> str:
    """One tritonserver command, as launch_triton_server.py (`--multi-model`) builds each rank's: worker
    ranks get no ports (they never serve)."""
    argv = ["tritonserver"]
    argv += [f"--{kind}-port={port}" for kind, port in (ports or {}).items()]
    if address is not None:
        argv += [f"--{kind}-address={address}" for kind in ports]
    argv += ["--model-control-mode=explicit", *(f"--load-model={name}" for name in load)]
    argv += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name={shm_prefix}"]
    return " ".join([argv[0], REPOSITORY_ARG, *map(shlex.quote, argv[1:]), *([RESTRICT_ARGS] if ports else [])])


def _environment_vars(spec: DeploymentSpec) -> list[tuple[str, str]]:
    env = [("TRTLLM_ORCHESTRATOR", "1"), ("TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES", "0")]
    # The disagg orchestrator reaches this node's engine models at the engines' private server.
    env.append((ENGINE_URL_ENV, f"http://127.0.0.1:{PRIVATE_PORTS['http']}"))
    if spec.disaggregated:
        env += versions.release_of(spec).transport_env(spec.kv_transfer.backend)
        if spec.kv_transfer.nvlink:
            env += NVLINK_ENV
    return env


def _engines_here(spec: DeploymentSpec, node: str) -> list[str]:
    """The engine models whose instances run on `node`: what its MPI rank 0 loads."""
    return [m for r in _roles(spec) if r.node == node for m in role_models(spec, r.name)]


def _front_models(spec: DeploymentSpec, models: list[str]) -> list[str]:
    """The models of the repository (`models`) that are no engine: ensembles, orchestrators, pre/post."""
    engines = {m for r in _roles(spec) for m in role_models(spec, r.name)}
    return [m for m in models if m not in engines]


def _connection(spec: DeploymentSpec, node: str) -> list[str]:
    all_nodes = nodes(spec)
    grpc = PORTS["grpc"]
    if spec.pools:
        lines = [f"Pool {node}: the front end reaches each replica's models over gRPC at port {grpc}, found through {node} (its Service)."]
        return lines + ([] if len(all_nodes) == 1 else
                        [f"KV blocks move between pools over {spec.kv_transfer.backend.upper()} (TRTLLM_USE_*_KVCACHE)."])
    if len(all_nodes) == 1:
        return []
    front = all_nodes[0]
    http = PORTS["http"]
    if node == front:
        remote = [f"{m} at {r.node}:{http}" for r in _roles(spec) if r.node != front for m in role_models(spec, r.name)]
        lines = [f"Front-end pool: the orchestrator here reaches {', '.join(remote)} over HTTP; start those pools too."]
    else:
        lines = [f"The orchestrator on {front} calls this pool's models over HTTP at {node}:{http}."]
    return lines + [f"KV blocks move between pools over {spec.kv_transfer.backend.upper()} (TRTLLM_USE_*_KVCACHE)."]


def _launch_script(spec: DeploymentSpec, node: str, models: list[str]) -> str:
    """The front node runs the front's models in a tritonserver of their own on the public ports, and its
    engines in the MPI world, whose rank 0 listens on loopback; another pool's rank 0 serves its engines
    on the usual ports, for the front node's orchestrator."""
    layout = mpi_world(spec, node)
    is_front = not spec.pools and node == nodes(spec)[0]
    rank0 = _engines_here(spec, node)
    if is_front:
        segments = [_server_argv(rank0, "prefix0_", PRIVATE_PORTS, "127.0.0.1")]
        front = front_server(spec, models)
    else:
        segments, front = [_server_argv(rank0, "prefix0_", PORTS)], None
    segments += [_server_argv([model_name(spec, x)], f"prefix{rank}_", None) for x in layout for rank in x.ranks]
    engines = {model_name(spec, x): gpt_model_path(spec, x.role) for x in layout}
    return render_template(
        "launch.sh.j2",
        source=spec.source or spec.name,
        node=node,
        release=versions.release_of(spec),
        world_size=len(segments),
        layout=layout,
        rank0_load=rank0,
        private_http=PRIVATE_PORTS["http"] if is_front else None,
        front=front,
        front_models=_front_models(spec, models) if is_front else [],
        connection=_connection(spec, node),
        env=_environment_vars(spec),
        repository=spec.model_repository.name,
        engines=engines,
        segments=segments,
    )


def front_server(spec: DeploymentSpec, models: list[str]) -> str:
    """The tritonserver command of the front end (every model of `models` that is no engine), on the
    standard ports: the one server clients reach."""
    return _server_argv(_front_models(spec, models), "front_", PORTS)


def render_launch_script(spec: DeploymentSpec, models: list[str]) -> dict[str, str]:
    """File name -> bash script: `launch.sh` for one node, else `launch-<node>.sh` per node; with pools,
    `launch-<pool>.sh` per pool and `launch-front.sh` for the front end, which no pool hosts. `models`
    names every model of the repository."""
    check_spec(spec)
    all_nodes = nodes(spec)
    if spec.pools:
        scripts = {f"launch-{node}.sh": _launch_script(spec, node, models) for node in all_nodes}
        front = render_template("launch-front.sh.j2", source=spec.source or spec.name, repository=spec.model_repository.name,
                                pools=all_nodes, command=front_server(spec, models))
        return {**scripts, "launch-front.sh": front}
    if len(all_nodes) == 1:
        return {"launch.sh": _launch_script(spec, all_nodes[0], models)}
    return {f"launch-{node}.sh": _launch_script(spec, node, models) for node in all_nodes}
