"""The security basics every rendered manifest must keep; the renderer refuses to write one that does not.

No privileged container, no privilege escalation, no capability beyond IPC_LOCK (and that only with host
networking, for RDMA), no host PID/IPC namespaces, host paths or host ports, host networking only where
the spec asks for it, and no Service reachable from outside the cluster but the front end's.
"""
from __future__ import annotations

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
FRONT_SERVICE = "front"


def _pod_problems(pod: dict, allow_host_network: bool) -> list[str]:
    problems = []
    if pod.get("hostNetwork") and not allow_host_network:
        problems.append("hostNetwork without kubernetes.host_network")
    problems += [f"{key}: true" for key in ("hostPID", "hostIPC") if pod.get(key)]
    problems += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        at = f"container {c['name']}"
        context = c.get("securityContext", {})
        if context.get("privileged", False):
            problems.append(f"{at}: privileged")
        if context.get("allowPrivilegeEscalation", True):
            problems.append(f"{at}: allowPrivilegeEscalation is not false")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{at}: capabilities do not drop ALL")
        allowed = {"IPC_LOCK"} if allow_host_network else set()
        problems += [f"{at}: adds capability {cap}" for cap in capabilities.get("add", []) if cap not in allowed]
        problems += [f"{at}: hostPort {p['hostPort']}" for p in c.get("ports", []) if "hostPort" in p]
    return problems


def lint(documents: list[dict], allow_host_network: bool, source: str = "") -> list[str]:
    """Every problem found in `documents` (parsed manifests), each naming the object; empty: clean."""
    problems = []
    for doc in documents:
        kind, meta = doc.get("kind"), doc.get("metadata", {})
        at = f"{source}: {kind} {meta.get('namespace', '')}/{meta.get('name', '')}".lstrip(": ")
        found = []
        if kind in WORKLOADS:
            found = _pod_problems(doc["spec"]["template"]["spec"], allow_host_network)
        elif kind == "Pod":
            found = _pod_problems(doc["spec"], allow_host_network)
        elif kind == "Service":
            service_type = doc["spec"].get("type", "ClusterIP")
            if service_type != "ClusterIP" and meta.get("name") != FRONT_SERVICE:
                found.append(f"type {service_type}: only the front end's Service may be reached from outside")
            if doc["spec"].get("externalIPs"):
                found.append("externalIPs")
        problems += [f"{at}: {p}" for p in found]
    return problems
