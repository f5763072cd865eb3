"""Renders a spec's Kubernetes manifests from the jinja2 templates in templates/k8s/.

Per pool a headless Service (one address per ready replica), a StatefulSet whose pods each run the pool's
launch script (one MPI world serving the pool's roles, disagg.trtllm.render) and a PodDisruptionBudget;
for the front end a Service, a Deployment (its tritonserver + the OpenAI-compatible API) and a budget;
the model repository and launch scripts as ConfigMaps; NetworkPolicies; a Prometheus scrape job; the
Dockerfile of the one image every pod runs. The repository inside is rendered for the pods: engines where
`kubernetes.engines_claim` is mounted, the orchestrators reaching each pool at its Service.
Every document is linted (disagg.k8s.lint) before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from disagg.k8s.lint import lint
from disagg.render import repository_files
from disagg.repository import render_template, write_changed
from disagg.spec import DeploymentSpec, PoolSpec, with_engine_root
from disagg.trtllm import versions
from disagg.trtllm.render import PORTS

ENGINES_MOUNT = "/engines"  # where engines_claim is mounted, unless output.engine_root names the place
REPOSITORY_MOUNT = "/repository"
LAUNCH_MOUNT = "/launch"
OPENAI_PORT = 9000
CONFIGMAP_LIMIT = 1 << 20  # bytes: what the API server stores in one ConfigMap
# Engines load for minutes (weights from the claim, KV pool allocation); a pod gets this long to be ready
# before it is restarted: 30 min for an engine pool, 10 for the front end.
ENGINE_STARTUP_CHECKS, FRONT_STARTUP_CHECKS = 180, 60
# An engine pod that is stopping keeps serving PRE_STOP_S while every front's orchestrator re-resolves its
# pool's name (every 0.25 s; CoreDNS gives Service records a 5 s TTL) and stops sending it requests, then
# waits up to DRAIN_S for the requests it holds (disagg.k8s.prestop), all before SIGTERM: mpirun passes
# that to every rank at once. A front pod waits FRONT_PRE_STOP_S while its Service stops sending it clients.
PRE_STOP_S, DRAIN_S, FRONT_PRE_STOP_S = 10, 40, 5
GRACE_S = 60
ENGINE_SHM, FRONT_SHM = "16Gi", "2Gi"


@dataclass(frozen=True)
class Container:
    name: str
    command: list[str]
    ports: list[tuple[str, int]]
    probe_port: int
    ready_path: str
    live_path: str
    startup_checks: int
    resources: dict
    mounts: list[tuple[str, str]]  # (volume, mount path)
    env: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Workload:
    """One StatefulSet or Deployment: what its pod template needs."""

    name: str
    replicas: int
    labels: dict[str, str]
    selector: dict[str, str]
    containers: list[Container]
    claims: list[tuple[str, str]]  # (volume, claim name)
    shm: str
    grace_s: int = GRACE_S
    pre_stop: list[str] = field(default_factory=list)  # the preStop hook's command
    gpus: int = 0
    hardware: str = "cpu"
    roles: tuple[str, ...] = ()
    node_selector: dict[str, str] = field(default_factory=dict)
    host_network: bool = False
    capabilities: dict = field(default_factory=lambda: {"drop": ["ALL"]})


def pod_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec as the pods see it: engines where the engines claim is mounted."""
    return spec if spec.engine_root is not None else with_engine_root(spec, ENGINES_MOUNT)


def _labels(spec: DeploymentSpec, component: str, tier: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component, "disagg.io/tier": tier}


def _selector(spec: DeploymentSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": component}


def _resources(cpu: str | None, memory: str | None, gpus: dict[str, int]) -> dict:
    """Requests as given; a memory limit equal to its request (the shared-memory volume counts against it);
    no CPU limit (throttling a server's threads costs latency); GPUs as limits, as extended resources are."""
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    limits = {**({"memory": memory} if memory else {}), **gpus}
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _triton(command: list[str], resources: dict, mounts: list[tuple[str, str]], startup_checks: int) -> Container:
    return Container(
        "triton", command, [(name, port) for name, port in PORTS.items()], PORTS["http"], "/v2/health/ready",
        "/v2/health/live", startup_checks, resources, mounts, [{"name": "MODEL_REPOSITORY", "value": REPOSITORY_MOUNT}],
    )


def pool_workload(spec: DeploymentSpec, pool: PoolSpec) -> Workload:
    k8s = spec.kubernetes
    gpus = len({d for r in pool.roles for devs in spec.roles[r].devices for d in devs})
    engine_mount = str(spec.engine_root)
    mounts = [("repository", REPOSITORY_MOUNT), ("launch", LAUNCH_MOUNT), ("engines", engine_mount), ("dshm", "/dev/shm")]
    resources = _resources(pool.cpu, pool.memory, {k8s.gpu_resource: gpus} if gpus else {})
    launch = spec.roles[pool.roles[0]].node  # a pool that shares its roles with an earlier one runs that one's script
    triton = _triton(["bash", f"{LAUNCH_MOUNT}/launch-{launch}.sh"], resources, mounts, ENGINE_STARTUP_CHECKS)
    capabilities = {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if k8s.host_network else {})}  # RDMA pins memory
    return Workload(
        name=pool.name, replicas=pool.replicas, labels=_labels(spec, pool.name, "engine"),
        selector=_selector(spec, pool.name), containers=[triton], claims=[("engines", k8s.engines_claim)],
        shm=ENGINE_SHM, gpus=gpus,
        pre_stop=["python3", "-m", "disagg.k8s.prestop", "--metrics", f"http://127.0.0.1:{PORTS['metrics']}/metrics",
                  "--after", str(PRE_STOP_S), "--timeout", str(DRAIN_S)], hardware=pool.hardware, roles=pool.roles,
        node_selector=dict(pool.node_selector), host_network=k8s.host_network, capabilities=capabilities,
    )


def front_workload(spec: DeploymentSpec) -> Workload:
    k8s = spec.kubernetes
    front = k8s.front
    mounts = [("repository", REPOSITORY_MOUNT), ("launch", LAUNCH_MOUNT), ("model", str(spec.model.path)), ("dshm", "/dev/shm")]
    triton = _triton(["bash", f"{LAUNCH_MOUNT}/launch-front.sh"], _resources(front.cpu, front.memory, {}), mounts,
                     FRONT_STARTUP_CHECKS)
    openai = Container(
        "openai",
        ["python3", "-m", "disagg.openai", "--model-repository", REPOSITORY_MOUNT, "--triton-grpc-url",
         f"127.0.0.1:{PORTS['grpc']}", "--host", "0.0.0.0", "--port", str(OPENAI_PORT),
         "--metrics-url", f"front=http://127.0.0.1:{PORTS['metrics']}/metrics"],
        [("openai", OPENAI_PORT)], OPENAI_PORT, "/ready", "/live", FRONT_STARTUP_CHECKS, {},
        [("repository", REPOSITORY_MOUNT), ("model", str(spec.model.path))],
    )
    return Workload(
        name="front", replicas=front.replicas, labels=_labels(spec, "front", "front"), selector=_selector(spec, "front"),
        containers=[triton, openai], claims=[("model", k8s.model_claim)], shm=FRONT_SHM, pre_stop=["sleep", str(FRONT_PRE_STOP_S)],
    )


def _config_key(path: Path) -> str:
    """A file's ConfigMap key (letters, digits, '-', '_', '.'): its path with '/' as '__'."""
    return str(path).replace("/", "__")


def _scrape_config(spec: DeploymentSpec) -> str:
    job = {
        "job_name": f"disagg-{spec.name}",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [spec.kubernetes.namespace]}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "regex": spec.name, "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "target_label": "pool"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }
    return yaml.safe_dump({"scrape_configs": [job]}, sort_keys=False)


def render_manifests(spec: DeploymentSpec) -> dict[str, str]:
    """File name -> text of every manifest (and the Dockerfile); raises ValueError when a document fails
    the lint or a ConfigMap would exceed its size limit."""
    spec = pod_spec(spec)
    k8s = spec.kubernetes
    files = repository_files(spec, Path("repository"))
    repository = {_config_key(p.relative_to("repository")): t for p, t in files.items() if p.parts[0] == "repository"}
    launch = {p.name: t for p, t in files.items() if p.parts[0] == "launch"}
    for name, data in (("repository", repository), ("launch", launch)):
        size = sum(len(k) + len(v.encode()) for k, v in data.items())
        if size > CONFIGMAP_LIMIT:
            raise ValueError(f"ConfigMap {name}: {size} bytes, above the API server's limit of {CONFIGMAP_LIMIT}")
    labels = {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": spec.name}
    front_ports = {"http": PORTS["http"], "grpc": PORTS["grpc"], "openai": OPENAI_PORT}
    common = {
        "source": spec.source or spec.name, "namespace": k8s.namespace, "labels": labels, "ports": PORTS,
        "image": k8s.image, "gpu_resource": k8s.gpu_resource, "front_ports": front_ports,
        "repository_items": [{"key": _config_key(p.relative_to("repository")), "path": str(p.relative_to("repository"))}
                             for p in sorted(files) if p.parts[0] == "repository"],
    }
    out = {"00-namespace.yaml": render_template("namespace.yaml.j2", **common, repository=repository, launch=launch)}
    for pool in spec.pools.values():
        out[f"10-pool-{pool.name}.yaml"] = render_template("pool.yaml.j2", **common, x=pool_workload(spec, pool))
    out["20-front.yaml"] = render_template("front.yaml.j2", **common, x=front_workload(spec), service_type=k8s.front.service_type)
    out["30-network.yaml"] = render_template(
        "network.yaml.j2", **common, instance={"app.kubernetes.io/instance": spec.name},
        front_selector=_selector(spec, "front"), engine_selector={"app.kubernetes.io/instance": spec.name, "disagg.io/tier": "engine"},
    )
    out["40-prometheus.yaml"] = render_template("prometheus.yaml.j2", **common, scrape=_scrape_config(spec))
    problems = [p for name, text in out.items() for p in lint(list(yaml.safe_load_all(text)), k8s.host_network, name)]
    if problems:
        raise ValueError("manifests fail the security lint:\n  " + "\n  ".join(problems))
    out["Dockerfile"] = render_template("Dockerfile.j2", source=spec.source or spec.name, name=spec.name, image=k8s.image,
                                        release=versions.release_of(spec))
    out["Dockerfile.dockerignore"] = render_template("Dockerfile.dockerignore.j2", source=spec.source or spec.name)
    return out


def write_manifests(spec: DeploymentSpec, out_dir: str | Path) -> list[Path]:
    """Writes the manifests into `out_dir` (default beside the repository: k8s/); returns the files changed."""
    return write_changed({Path(out_dir) / name: text for name, text in render_manifests(spec).items()})
