"""Placement planning against recorded topologies: tables, links, rejections, and the no-driver path."""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pynvml
import pytest
from safetensors.numpy import save_file

from disagg.placement import inventory as inventory_module
from disagg.placement.inventory import GpuInventory, inventory, no_driver_reason
from disagg.placement.plan import format_plan, make_plan, model_size
from disagg.spec import SpecError
from trtllm_helpers import LLAMA_3_1_8B, LLAMA_3_1_8B_PARAMS, TOPOLOGY, example_spec, model_dir

GIB = 1024**3
MIB = 1024**2
LLAMA_3_1_70B = {
    **LLAMA_3_1_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def _load(name: str) -> GpuInventory:
    return GpuInventory.load(TOPOLOGY / f"{name}.json")


def _rows(table: str) -> list[list[str]]:
    """Table rows split on runs of 2+ spaces, header excluded."""
    lines = table.splitlines()[2:]
    return [re.split(r" {2,}", line.strip()) for line in lines if not line.startswith("note:")]


def _with_devices(spec, **devices):
    roles = {name: dataclasses.replace(role, devices=devices.get(name, role.devices)) for name, role in spec.roles.items()}
    return dataclasses.replace(spec, roles=roles)


@pytest.fixture
def h200(tmp_path):
    return example_spec("h200x8-intra-node", model_dir(tmp_path))


def test_fixtures_load_and_name_their_links():
    hgx, box, two = _load("h200x8-nvswitch"), _load("pcie4-l40s"), _load("2socket-pcie8-a100")
    assert (len(hgx.gpus), len(box.gpus), len(two.gpus)) == (8, 4, 8)
    assert hgx.link_name((0, 1, 2, 3)) == "NVSwitch (NV18)"
    assert box.link_name((0, 1)) == "PCIe (PIX)"
    assert box.link_name((0, 1, 2, 3)) == "PCIe (NODE)"
    assert two.link_name((2, 3)) == "PCIe (PIX)"
    assert two.link_name((3, 4)) == "cross-socket (SYS)"
    assert two.link_name((5,)) == "-"
    assert GpuInventory.from_json(hgx.to_json()) == hgx


def test_h200_plan_table(h200):
    plan = make_plan(h200, _load("h200x8-nvswitch"))
    weights = math.ceil(LLAMA_3_1_8B_PARAMS * 2 / 4), math.ceil(LLAMA_3_1_8B_PARAMS * 2 / 2)
    memory = 143771 * MIB
    # KV per token per GPU: K+V x 32 layers x (8 KV heads / TP) x 128 x 2 bytes
    prefill_tokens = int(0.85 * (memory - weights[0]) // (2 * 32 * 2 * 128 * 2))
    decode_tokens = int(0.9 * (memory - weights[1]) // (2 * 32 * 4 * 128 * 2))
    assert [(p.role, p.instance, p.devices, p.weight_bytes_per_gpu, p.kv_tokens) for p in plan.placements] == [
        ("prefill", 0, (0, 1, 2, 3), weights[0], prefill_tokens),
        ("decode", 0, (4, 5), weights[1], decode_tokens),
        ("decode", 1, (6, 7), weights[1], decode_tokens),
    ]
    table = format_plan(plan)
    assert table.splitlines()[0] == "placement plan for h200x8-intra-node (backend tensorrt_llm)"
    assert _rows(table) == [
        ["prefill", "0", "localhost", "0,1,2,3", "4 x 1", "3.7 GiB", f"{prefill_tokens:,}", "NVSwitch (NV18)", "0"],
        ["decode", "0", "localhost", "4,5", "2 x 1", "7.5 GiB", f"{decode_tokens:,}", "NVSwitch (NV18)", "1"],
        ["decode", "1", "localhost", "6,7", "2 x 1", "7.5 GiB", f"{decode_tokens:,}", "NVSwitch (NV18)", "1"],
    ]
    assert "note: GPUs on h200-node: 8 x NVIDIA H200 (140.4 GiB), driver 570.124.06" in table
    assert "8,030,261,248 parameters from config.json (no *.safetensors found) x bfloat16 = 15.0 GiB" in table
    assert "KV cache: 128.0 KiB per token" in table


def test_pcie_box_plan(tmp_path):
    def four_gpus(raw):
        raw["roles"]["prefill"].update(tp=2, devices=[[0, 1]])
        raw["roles"]["decode"].update(tp=1, instances=2, devices=[[2], [3]])

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), four_gpus)
    rows = _rows(format_plan(make_plan(spec, _load("pcie4-l40s"))))
    assert [(r[0], r[3], r[4], r[5], r[7]) for r in rows] == [
        ("prefill", "0,1", "2 x 1", "7.5 GiB", "PCIe (PIX)"),
        ("decode", "2", "1 x 1", "15.0 GiB", "-"),
        ("decode", "3", "1 x 1", "15.0 GiB", "-"),
    ]


def test_two_socket_plan_flags_a_tp_group_across_sockets(tmp_path):
    def straddle(raw):
        raw["roles"]["prefill"]["devices"] = [[2, 3, 4, 5]]
        raw["roles"]["decode"]["devices"] = [[0, 1], [6, 7]]

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), straddle)
    rows = _rows(format_plan(make_plan(spec, _load("2socket-pcie8-a100"))))
    assert [(r[0], r[3], r[7], r[8]) for r in rows] == [
        ("prefill", "2,3,4,5", "cross-socket (SYS)", "0,1"),
        ("decode", "0,1", "PCIe (PIX)", "0"),
        ("decode", "6,7", "PCIe (PIX)", "1"),
    ]


def test_pipeline_stages_report_their_slowest_tp_group(tmp_path):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["roles"]["prefill"].update(tp=2, pp=2))
    # TP groups (2,3) and (4,5) on one socket each; only the PP hop 3 -> 4 crosses sockets.
    decode = ((0, 1), (6, 7))
    two_sockets = _load("2socket-pcie8-a100")
    placement = make_plan(_with_devices(spec, prefill=((2, 3, 4, 5),), decode=decode), two_sockets).placements[0]
    assert placement.link == "PCIe (PIX)"
    placement = make_plan(_with_devices(spec, prefill=((2, 4, 3, 5),), decode=decode), two_sockets).placements[0]
    assert placement.link == "cross-socket (SYS)"


def test_no_driver_says_so_and_still_checks_the_spec(h200, monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    assert inventory() is None
    assert no_driver_reason() == "no NVIDIA driver: NVML could not be initialised (NVML Shared Library Not Found)"
    table = format_plan(make_plan(h200, None))
    assert [(r[3], r[6], r[7]) for r in _rows(table)] == [("0,1,2,3", "?", "?"), ("4,5", "?", "?"), ("6,7", "?", "?")]
    assert (
        "note: no NVIDIA driver: NVML could not be initialised (NVML Shared Library Not Found): "
        "device ids, GPU memory, KV capacity and links not checked (spec checks passed)"
    ) in table
    with pytest.raises(SpecError, match=r"^roles\.decode\.devices\.0: GPU 3 on node 'localhost' is already used"):
        make_plan(_with_devices(h200, decode=((3, 4), (6, 7))), None)


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ({"decode": ((3, 4), (6, 7))}, r"roles\.decode\.devices\.0: GPU 3 on node 'localhost' is already used by roles\.prefill\.devices\.0"),
        ({"decode": ((4, 5), (5, 6))}, r"roles\.decode\.devices\.1: GPU 5 on node 'localhost' is already used by roles\.decode\.devices\.0"),
        ({"decode": ((4, 5, 6), (7, 0))}, r"roles\.decode\.devices\.0: 3 devices \[4, 5, 6\] but tp\*pp = 2\*1 = 2"),
        ({"decode": ((4, 5),)}, r"roles\.decode\.devices: 1 device lists for instances=2"),
        ({"prefill": ()}, r"roles\.prefill\.devices: required with backend tensorrt_llm"),
    ],
)  # fmt: skip
def test_device_rejections(h200, devices, message):
    with pytest.raises(SpecError, match="^" + message):
        make_plan(_with_devices(h200, **devices), _load("h200x8-nvswitch"))


def test_devices_absent_from_the_machine_are_rejected(h200):
    with pytest.raises(SpecError, match=r"^roles\.decode\.devices\.0: GPU 4 is not on pcie-box \(it has GPUs 0-3\)$"):
        make_plan(h200, _load("pcie4-l40s"))


def test_weights_that_do_not_fit_are_rejected(tmp_path):
    def on_four_gpus(raw):
        raw["roles"]["prefill"].update(tp=2, devices=[[0, 1]])
        raw["roles"]["decode"].update(tp=2, instances=1, devices=[[2, 3]])

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path, LLAMA_3_1_70B), on_four_gpus)
    with pytest.raises(SpecError) as err:
        make_plan(spec, _load("pcie4-l40s"))
    assert str(err.value).startswith(
        "roles.prefill: weights need 65.7 GiB per GPU but GPU 0 (NVIDIA L40S, 45.0 GiB) leaves 0.0 GiB for the KV cache"
    )
    assert str(err.value).endswith("less than one sequence of max_seq_len=8193")


def test_kv_cache_that_cannot_hold_one_sequence_is_rejected(h200):
    starved = dataclasses.replace(h200.roles["decode"], kv_cache_free_gpu_mem_fraction=0.00001)
    spec = dataclasses.replace(h200, roles={**h200.roles, "decode": starved})
    with pytest.raises(SpecError, match=r"^roles\.decode: weights need 7\.5 GiB per GPU but GPU 4 \(NVIDIA H200, 140\.4 GiB\) leaves 0\.0 GiB"):
        make_plan(spec, _load("h200x8-nvswitch"))


def test_two_pools_check_only_the_node_they_run_on(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path))
    here = dataclasses.replace(_load("h200x8-nvswitch"), hostname="decode-pool")
    table = format_plan(make_plan(spec, here))
    rows = _rows(table)
    assert [(r[2], r[6] == "?", r[7]) for r in rows] == [("prefill-pool", True, "?")] * 4 + [
        ("decode-pool", False, "NVSwitch (NV18)")
    ] * 2
    assert "note: node 'prefill-pool' is not this machine (decode-pool): plan there to check its GPUs" in table


def test_weights_from_safetensors_headers(tmp_path):
    model = model_dir(tmp_path)
    save_file({"a": np.zeros((4, 8), np.float32), "b": np.zeros((16,), np.float32)}, str(model / "model.safetensors"))
    spec = example_spec("h200x8-intra-node", model)
    size = model_size(spec)
    assert (size.params, size.weight_bytes, size.source) == (48, 96, "safetensors headers of 1 file(s)")


def test_weights_from_config_json_alone(h200):
    size = model_size(h200)
    assert (size.params, size.source) == (LLAMA_3_1_8B_PARAMS, "config.json (no *.safetensors found)")
    assert size.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_reference_backend_plan(tmp_path):
    def reference(raw):
        raw.update(backend="reference")
        del raw["trtllm_release"]
        raw["model"]["dtype"] = "float32"
        for role in raw["roles"].values():
            role.pop("devices")

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), reference)
    table = format_plan(make_plan(spec, None))
    prefill = spec.roles["prefill"]
    assert _rows(table)[0][3:8] == ["cpu", "4 x 1", "7.5 GiB", f"{prefill.kv_cache_blocks * 32:,}", "in-process"]
    assert "note: reference engine: runs on CPU" in table


class FakeNvml:
    """Three GPUs: 0 and 1 joined by two direct NVLinks, 2 on the other socket over PCIe."""

    buses = ["00000000:1B:00.0", "00000000:1C:00.0", "00000000:DB:00.0"]

    def __init__(self, monkeypatch):
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name))

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlSystemGetDriverVersion(self): return b"570.124.06"
    def nvmlDeviceGetCount(self): return 3
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return "NVIDIA H100 PCIe"
    def nvmlDeviceGetMemoryInfo(self, h): return type("Mem", (), {"total": 81559 * MIB})
    def nvmlDeviceGetCudaComputeCapability(self, h): return (9, 0)
    def nvmlDeviceGetPciInfo(self, h): return type("Pci", (), {"busId": self.buses[h].encode()})
    def nvmlDeviceGetNumaNodeId(self, h): return 0 if h < 2 else 1
    def nvmlDeviceGetCpuAffinity(self, h, words): return [0b1_0000_1111 if h < 2 else 0b1111_0000]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 2 or link >= 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return type("Pci", (), {"busId": ("0000:1c:00.0" if h == 0 else "0000:1b:00.0")})

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link): return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    def nvmlDeviceGetTopologyCommonAncestor(self, a, b): return pynvml.NVML_TOPOLOGY_SYSTEM  # fmt: skip


def test_inventory_reads_nvml(monkeypatch):
    FakeNvml(monkeypatch)
    inv = inventory()
    assert inv.driver_version == "570.124.06"
    assert inv.topology == (("X", "NV2", "SYS"), ("NV2", "X", "SYS"), ("SYS", "SYS", "X"))
    gpu0, _, gpu2 = inv.gpus
    assert (gpu0.name, gpu0.memory_bytes, gpu0.pci_bus_id) == ("NVIDIA H100 PCIe", 81559 * MIB, "0000:1b:00.0")
    assert (gpu0.numa_node, gpu0.cpu_affinity, gpu0.nvlinks, gpu0.nvswitch) == (0, "0-3,8", 2, False)
    assert gpu0.compute_capability == "sm90"
    assert (gpu2.numa_node, gpu2.cpu_affinity, gpu2.nvlinks) == (1, "4-7", 0)
    assert inv.link_name((0, 1)) == "NVLink (NV2)"
    assert inv.link_name((1, 2)) == "cross-socket (SYS)"
    assert no_driver_reason() is None
    assert inventory_module.GpuInventory.from_json(inv.to_json()) == inv
