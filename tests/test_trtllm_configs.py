"""Rendered tensorrtllm configs parse as Triton ModelConfig; launch scripts have the right MPI world."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.render import engine_urls, plan_models
from disagg.spec import SpecError
from disagg.triton.contract import parse_engine_urls
from disagg.trtllm.build import dry_run_lines
from disagg.trtllm.render import render_engine_config, render_launch_script
from trtllm_helpers import example_spec, model_dir

ORCHESTRATOR_INPUTS = {
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "streaming", "temperature",
    "runtime_top_k", "runtime_top_p", "seed", "stop", "context_phase_params",
}  # fmt: skip
ORCHESTRATOR_OUTPUTS = {
    "output_ids", "sequence_length", "context_phase_params", "first_token_time_ns", "arrival_time_ns",
    "kv_cache_reused_blocks",
}  # fmt: skip
TYPES = model_config_pb2.DataType


def _parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _params(config) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.fixture
def h200(tmp_path):
    return example_spec("h200x8-intra-node", model_dir(tmp_path))


def test_h200_prefill_and_decode_configs(h200):
    prefill, decode = (_parse(render_engine_config(h200, role)) for role in ("prefill", "decode"))
    for config, role in ((prefill, "prefill"), (decode, "decode")):
        assert config.name == role
        assert config.backend == "tensorrtllm"
        assert [(g.count, g.kind) for g in config.instance_group] == [
            (h200.roles[role].instances, model_config_pb2.ModelInstanceGroup.KIND_CPU)
        ]
        params = _params(config)
        assert params["gpt_model_path"] == str((h200.build_dir / "engines" / role).absolute())
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["max_beam_width"] == "1"
        assert params["exclude_input_in_output"] == "true"
        assert params["cancellation_check_period_ms"] == "20"
        assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert (prefill.max_batch_size, decode.max_batch_size) == (8, 256)
    assert prefill.model_transaction_policy.decoupled is True
    assert decode.model_transaction_policy.decoupled is True
    assert list(prefill.dynamic_batching.preferred_batch_size) == [8]

    p, d = _params(prefill), _params(decode)
    assert (p["gpu_device_ids"], p["participant_ids"]) == ("0,1,2,3", "1,2,3,4")
    assert (d["gpu_device_ids"], d["participant_ids"]) == ("4,5;6,7", "5,6;7,8")
    assert (p["enable_kv_cache_reuse"], d["enable_kv_cache_reuse"]) == ("true", "false")
    assert (p["kv_cache_free_gpu_mem_fraction"], d["kv_cache_free_gpu_mem_fraction"]) == ("0.85", "0.9")


def test_engine_io_follows_the_tensorrtllm_contract(h200):
    config = _parse(render_engine_config(h200, "decode"))
    inputs = {t.name: t for t in config.input}
    outputs = {t.name: t for t in config.output}
    assert ORCHESTRATOR_INPUTS <= inputs.keys() and ORCHESTRATOR_OUTPUTS <= outputs.keys()
    assert [n for n, t in inputs.items() if not t.optional] == ["input_lengths", "request_output_len"]
    assert (inputs["input_ids"].data_type, list(inputs["input_ids"].dims)) == (TYPES.TYPE_INT32, [-1])
    assert inputs["input_ids"].allow_ragged_batch
    scalar = inputs["request_output_len"]
    assert (list(scalar.dims), list(scalar.reshape.shape), scalar.reshape.ByteSize()) == ([1], [], 0)
    assert scalar.HasField("reshape")
    assert inputs["seed"].data_type == TYPES.TYPE_UINT64
    assert inputs["streaming"].data_type == inputs["stop"].data_type == TYPES.TYPE_BOOL
    assert inputs["temperature"].data_type == inputs["runtime_top_p"].data_type == TYPES.TYPE_FP32
    assert list(inputs["stop_words_list"].dims) == [2, -1]
    ctx_in, ctx_out = inputs["context_phase_params"], outputs["context_phase_params"]
    assert (ctx_in.data_type, list(ctx_in.dims), ctx_in.allow_ragged_batch) == (TYPES.TYPE_UINT8, [-1], True)
    assert (ctx_out.data_type, list(ctx_out.dims)) == (TYPES.TYPE_UINT8, [-1])
    assert list(outputs["output_ids"].dims) == [-1, -1]
    assert outputs["first_token_time_ns"].data_type == TYPES.TYPE_INT64


def test_aggregated_engine_shares_the_world_under_the_repository_name(tmp_path):
    def with_baseline(raw):
        raw["roles"]["decode"].update(instances=1, devices=[[4, 5]])
        raw["roles"]["aggregated"] = {**raw["roles"]["decode"], "devices": [[6, 7]], "max_num_tokens": 8192}

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), with_baseline)
    config = _parse(render_engine_config(spec, "aggregated"))
    assert config.name == "aggregated_engine" and config.model_transaction_policy.decoupled
    assert (_params(config)["gpu_device_ids"], _params(config)["participant_ids"]) == ("6,7", "7,8")
    segments = _mpirun_segments(render_launch_script(spec)["launch.sh"])
    assert [a for a in segments[-1] if a.startswith("--load-model=")] == ["--load-model=aggregated_engine"]


def test_two_pools_ids_restart_in_each_pool(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path))
    prefill, decode = (_params(_parse(render_engine_config(spec, r))) for r in ("prefill", "decode"))
    assert (prefill["gpu_device_ids"], prefill["participant_ids"]) == ("0,1;2,3;4,5;6,7", "1,2;3,4;5,6;7,8")
    assert (decode["gpu_device_ids"], decode["participant_ids"]) == ("0,1,2,3;4,5,6,7", "1,2,3,4;5,6,7,8")


def _mpirun_segments(script: str) -> list[list[str]]:
    """The MPMD segments of the script's mpirun line, each without its `-n 1`."""
    line = script[script.index("exec mpirun") :].replace("\\\n", " ")
    argv = shlex.split(line)
    assert argv[:3] == ["exec", "mpirun", "--allow-run-as-root"]
    segments, current = [], []
    for arg in argv[3:] + [":"]:
        if arg == ":":
            assert current[:2] == ["-n", "1"]
            segments.append(current[2:])
            current = []
        else:
            current.append(arg)
    return segments


def _exports(script: str) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S+)$", script, re.M))


def test_h200_launch_script(h200):
    scripts = render_launch_script(h200)
    assert list(scripts) == ["launch.sh"]
    script = scripts["launch.sh"]
    segments = _mpirun_segments(script)
    assert len(segments) == 9  # 1 orchestrator + prefill 1 x TP4 + decode 2 x TP2
    assert "One MPI world of 9 ranks" in script
    repo = f"--model-repository={h200.model_repository.absolute()}"
    for rank, argv in enumerate(segments):
        assert argv[:2] == ["tritonserver", repo]
        assert "--disable-auto-complete-config" in argv
        assert argv[-1] == f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"
    assert not any(a.startswith("--model-control-mode") for a in segments[0])  # rank 0 loads everything
    loads = [[a for a in argv if a.startswith("--load-model=")] for argv in segments[1:]]
    assert loads == [["--load-model=prefill"]] * 4 + [["--load-model=decode"]] * 4
    assert all("--model-control-mode=explicit" in argv for argv in segments[1:])
    assert _exports(script) == {
        "DISAGG_ENGINE_GRPC_URL": "127.0.0.1:8001",
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "0",
        "TRTLLM_USE_UCX_KVCACHE": "1",
        "UCX_MEMTYPE_CACHE": "n",
        "UCX_RNDV_FRAG_MEM_TYPES": "cuda",
        "UCX_RNDV_PIPELINE_ERROR_HANDLING": "y",
        "TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE": "0B",
    }


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_launch_scripts_are_valid_bash(h200, tmp_path):
    two_pools = example_spec("two-pools", model_dir(tmp_path))
    for spec in (h200, two_pools):
        for name, text in render_launch_script(spec).items():
            path = tmp_path / name
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)


def test_kv_backend_selects_the_transceiver_and_nvlink_is_optional(tmp_path):
    def mpi_without_nvlink(raw):
        raw["kv_transfer"] = {"backend": "mpi", "nvlink": False}

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), mpi_without_nvlink)
    exports = _exports(render_launch_script(spec)["launch.sh"])
    assert exports["TRTLLM_USE_MPI_KVCACHE"] == "1"
    assert not any(k.startswith("UCX_") or k.startswith("TRTLLM_USE_UCX") for k in exports)


def test_two_pools_get_one_script_and_world_each(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path))
    scripts = render_launch_script(spec)
    assert list(scripts) == ["launch-prefill-pool.sh", "launch-decode-pool.sh"]
    front, back = (_mpirun_segments(scripts[name]) for name in scripts)
    assert len(front) == len(back) == 9  # 1 + 4 x TP2, and 1 + 2 x TP4
    # Rank 0 of the first pool serves the whole repository but the other pool's engine.
    assert [a for a in front[0] if a.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=postprocessing", "--load-model=prefill",
        "--load-model=disagg_orchestrator", "--load-model=ensemble",
    ]  # fmt: skip
    assert [a for a in back[0] if a.startswith("--load-model=")] == ["--load-model=decode"]
    assert "the orchestrator here reaches decode at decode-pool:8001 over gRPC" in scripts["launch-prefill-pool.sh"]
    assert "calls this pool's models over gRPC at decode-pool:8001" in scripts["launch-decode-pool.sh"]
    assert _exports(scripts["launch-decode-pool.sh"])["TRTLLM_USE_UCX_KVCACHE"] == "1"
    assert "UCX_MEMTYPE_CACHE" not in _exports(scripts["launch-decode-pool.sh"])  # nvlink: false


def test_the_front_pool_orchestrator_calls_the_decode_pool_at_its_server(tmp_path):
    two_pools = example_spec("two-pools", model_dir(tmp_path))
    assert engine_urls(two_pools) == "decode=decode-pool:8001"
    orchestrator = next(m for m in plan_models(two_pools) if m.name == "disagg_orchestrator")
    assert parse_engine_urls(_params(_parse(orchestrator.config))["engine_urls"]) == {"decode": "decode-pool:8001"}
    assert engine_urls(example_spec("h200x8-intra-node", model_dir(tmp_path))) == ""  # one node: all local


@pytest.mark.parametrize("value", ["decode", "decode=", "=h:1", "decode=host"])
def test_a_malformed_engine_url_is_refused(value):
    with pytest.raises(ValueError, match="is not model=host:port"):
        parse_engine_urls(value)


@pytest.mark.parametrize(
    ("kv_transfer", "message"),
    [
        ({"backend": "shm"}, r"^kv_transfer\.backend: 'shm' is a reference-engine transport; TensorRT-LLM's cache transceiver uses ucx, nixl, mpi$"),
        ({"backend": "mpi"}, r"^kv_transfer\.backend: 'mpi' needs prefill and decode in one MPI world, but roles run on nodes prefill-pool, decode-pool"),
    ],
)  # fmt: skip
def test_kv_transports_the_engine_cannot_use_are_rejected(tmp_path, kv_transfer, message):
    spec = example_spec("two-pools", model_dir(tmp_path), lambda raw: raw.update(kv_transfer=kv_transfer))
    with pytest.raises(SpecError, match=message):
        render_launch_script(spec)
    with pytest.raises(SpecError, match=message):
        render_engine_config(spec, "decode")
    with pytest.raises(SpecError, match=message):  # before any build work
        dry_run_lines(spec, ["prefill"])


def test_roles_must_share_the_kv_block_size(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path), lambda raw: raw["roles"]["decode"].update(tokens_per_block=64))
    with pytest.raises(SpecError, match=r"^roles\.decode\.tokens_per_block: 64 differs from roles\.prefill\.tokens_per_block=32"):
        render_engine_config(spec, "prefill")


def test_node_names_must_be_host_names(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path), lambda raw: raw["roles"]["decode"].update(node="decode pool"))
    with pytest.raises(SpecError, match=r"^roles\.decode\.node: 'decode pool' is not a host name"):
        render_launch_script(spec)
