"""The GPUs of this machine and how they are connected, read with NVML (nvidia-ml-py) or from JSON.

Links are stored as `nvidia-smi topo -m` codes, the vocabulary operators already read:
`NV<n>` (n NVLinks, direct or through NVSwitch), `PIX` (one PCIe switch), `PXB` (several PCIe
switches), `PHB` (a PCIe host bridge), `NODE` (across host bridges within one NUMA node) and `SYS`
(across the inter-socket link). A recorded JSON (see `python -m disagg.placement.inventory`) loads into
the same dataclass, so planning is tested against real topologies on machines without GPUs.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import pynvml

# Worst link last: a TP group is as fast as its slowest pair.
_SEVERITY = {"NV": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}
_NVML_LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: "X",
    pynvml.NVML_TOPOLOGY_SINGLE: "PIX",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    pynvml.NVML_TOPOLOGY_NODE: "NODE",
    pynvml.NVML_TOPOLOGY_SYSTEM: "SYS",
}


def link_rank(code: str | None) -> int:
    """Orders topology codes from fastest to slowest; None (a single GPU, no link) first."""
    return -1 if code is None else _SEVERITY["NV" if code.startswith("NV") else code]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str
    numa_node: int | None
    cpu_affinity: str  # CPU list, e.g. "0-47,96-143"
    nvlinks: int  # active NVLink links
    nvswitch: bool  # the links go to NVSwitches: all-to-all at full NVLink bandwidth
    compute_capability: str = ""  # "sm90": the architecture a TensorRT engine built here runs on


@dataclass(frozen=True)
class GpuInventory:
    hostname: str
    driver_version: str
    gpus: tuple[Gpu, ...]  # gpus[i].index == i
    topology: tuple[tuple[str, ...], ...]  # [i][j]: nvidia-smi topo code, "X" on the diagonal

    def has(self, index: int) -> bool:
        return 0 <= index < len(self.gpus)

    def link_code(self, devices: tuple[int, ...]) -> str | None:
        """The slowest link between any two of `devices`; None for a single device."""
        codes = [self.topology[a][b] for i, a in enumerate(devices) for b in devices[i + 1 :]]
        return max(codes, key=link_rank, default=None)

    def link_name(self, devices: tuple[int, ...]) -> str:
        """`NVSwitch (NV18)`, `NVLink (NV4)`, `PCIe (PIX)` or `cross-socket (SYS)`; `-` for one device."""
        code = self.link_code(devices)
        if code is None:
            return "-"
        if code.startswith("NV"):
            kind = "NVSwitch" if all(self.gpus[d].nvswitch for d in devices) else "NVLink"
        else:
            kind = "cross-socket" if code == "SYS" else "PCIe"
        return f"{kind} ({code})"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GpuInventory:
        gpus = tuple(Gpu(**g) for g in data["gpus"])
        if [g.index for g in gpus] != list(range(len(gpus))):
            raise ValueError("gpus must be listed by index, 0..n-1")
        topology = tuple(tuple(row) for row in data["topology"])
        if len(topology) != len(gpus) or any(len(row) != len(gpus) for row in topology):
            raise ValueError(f"topology must be {len(gpus)} x {len(gpus)}")
        return cls(data["hostname"], data["driver_version"], gpus, topology)

    @classmethod
    def load(cls, path: str | Path) -> GpuInventory:
        return cls.from_json(json.loads(Path(path).read_text()))


def no_driver_reason() -> str | None:
    """Why NVML is unusable here, in plain words; None when it initialises."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA driver: NVML could not be initialised ({exc})"
    pynvml.nvmlShutdown()
    return None


def inventory() -> GpuInventory | None:
    """This machine's GPUs, or None without a working NVIDIA driver (see `no_driver_reason`)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return _read_nvml()
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bus_id(value: str | bytes) -> str:
    """NVML spells PCI domains with 4 or 8 hex digits depending on the call; compare them as 4."""
    domain, rest = _text(value).lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def _nvlink_peers(handle) -> list[tuple[str, bool]]:
    """(remote PCI bus id, remote is an NVSwitch) for each active NVLink of one GPU."""
    peers = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except pynvml.NVMLError:  # no NVLink on this GPU, or past its last link
            continue
        peers.append((remote, kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH))
    return peers


def _cpu_list(handle) -> str:
    words = -(-(os.cpu_count() or 1) // 64)
    mask = pynvml.nvmlDeviceGetCpuAffinity(handle, words)
    cpus = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1]
    ranges: list[list[int]] = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _numa_node(handle, bus_id: str) -> int | None:
    try:
        return pynvml.nvmlDeviceGetNumaNodeId(handle)
    except pynvml.NVMLError:  # older drivers: ask sysfs
        try:
            node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None


def _read_nvml() -> GpuInventory:
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    bus_ids = [_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    peers = [_nvlink_peers(h) for h in handles]
    gpus = tuple(
        Gpu(
            index=i,
            name=_text(pynvml.nvmlDeviceGetName(h)),
            memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
            pci_bus_id=bus_ids[i],
            numa_node=_numa_node(h, bus_ids[i]),
            cpu_affinity=_cpu_list(h),
            nvlinks=len(peers[i]),
            nvswitch=any(switch for _, switch in peers[i]),
            compute_capability="sm{}{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(h)),
        )
        for i, h in enumerate(handles)
    )

    def code(i: int, j: int) -> str:
        if i == j:
            return "X"
        if gpus[i].nvswitch and gpus[j].nvswitch:
            return f"NV{min(gpus[i].nvlinks, gpus[j].nvlinks)}"
        direct = sum(remote == bus_ids[j] for remote, _ in peers[i])
        if direct:
            return f"NV{direct}"
        return _NVML_LEVELS[pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])]

    topology = tuple(tuple(code(i, j) for j in range(len(gpus))) for i in range(len(gpus)))
    return GpuInventory(socket.gethostname(), _text(pynvml.nvmlSystemGetDriverVersion()), gpus, topology)


if __name__ == "__main__":  # records a topology fixture: python -m disagg.placement.inventory > node.json
    found = inventory()
    if found is None:
        raise SystemExit(no_driver_reason())
    print(json.dumps(found.to_json(), indent=2))
