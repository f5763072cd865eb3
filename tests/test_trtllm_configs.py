"""Rendered tensorrtllm configs parse as Triton ModelConfig; launch scripts have the right MPI world."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.render import engine_urls, plan_models
from disagg.spec import SpecError
from disagg.triton.contract import parse_engine_urls
from disagg.triton.load_board import pid_alive
from disagg.trtllm.build import dry_run_lines
from disagg.trtllm.render import render_engine_configs, render_launch_script
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


def _scripts(spec) -> dict[str, str]:
    return render_launch_script(spec, [m.name for m in plan_models(spec)])


def _parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _params(config) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.fixture
def h200(tmp_path):
    return example_spec("h200x8-intra-node", model_dir(tmp_path))


def _configs(spec, role: str) -> dict[str, model_config_pb2.ModelConfig]:
    return {name: _parse(text) for name, text in render_engine_configs(spec, role).items()}


def test_h200_prefill_and_decode_configs(h200):
    prefill, decode = _configs(h200, "prefill"), _configs(h200, "decode")
    assert list(prefill) == ["prefill"] and list(decode) == ["decode", "decode_1"]  # a model per instance
    for name, config in {**prefill, **decode}.items():
        role = name.split("_")[0]
        assert config.name == name
        assert config.backend == "tensorrtllm"
        assert [(g.count, g.kind) for g in config.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
        params = _params(config)
        assert params["gpt_model_path"] == str((h200.build_dir / "engines" / role).absolute())
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["max_beam_width"] == "1"
        assert params["exclude_input_in_output"] == "true"
        assert params["cancellation_check_period_ms"] == "20"
        assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert (prefill["prefill"].max_batch_size, decode["decode_1"].max_batch_size) == (8, 256)
    assert all(c.model_transaction_policy.decoupled is True for c in (*prefill.values(), *decode.values()))
    assert list(prefill["prefill"].dynamic_batching.preferred_batch_size) == [8]

    p, d0, d1 = _params(prefill["prefill"]), _params(decode["decode"]), _params(decode["decode_1"])
    assert (p["gpu_device_ids"], p["participant_ids"]) == ("0,1,2,3", "1,2,3,4")
    assert (d0["gpu_device_ids"], d0["participant_ids"]) == ("4,5", "5,6")
    assert (d1["gpu_device_ids"], d1["participant_ids"]) == ("6,7", "7,8")
    assert (p["enable_kv_cache_reuse"], d0["enable_kv_cache_reuse"]) == ("true", "false")
    assert (p["kv_cache_free_gpu_mem_fraction"], d0["kv_cache_free_gpu_mem_fraction"]) == ("0.85", "0.9")


def test_engine_io_follows_the_tensorrtllm_contract(h200):
    config = _configs(h200, "decode")["decode"]
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
    config = _configs(spec, "aggregated")["aggregated_engine"]
    assert config.name == "aggregated_engine" and config.model_transaction_policy.decoupled
    assert (_params(config)["gpu_device_ids"], _params(config)["participant_ids"]) == ("6,7", "7,8")
    segments = _mpirun_segments(_scripts(spec)["launch.sh"])
    assert [a for a in segments[-1] if a.startswith("--load-model=")] == ["--load-model=aggregated_engine"]


def test_two_pools_ids_restart_in_each_pool(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path))
    ids = {name: (_params(c)["gpu_device_ids"], _params(c)["participant_ids"])
           for role in ("prefill", "decode") for name, c in _configs(spec, role).items()}
    assert ids == {
        "prefill": ("0,1", "1,2"), "prefill_1": ("2,3", "3,4"), "prefill_2": ("4,5", "5,6"), "prefill_3": ("6,7", "7,8"),
        "decode": ("0,1,2,3", "1,2,3,4"), "decode_1": ("4,5,6,7", "5,6,7,8"),
    }  # fmt: skip


def _mpirun_segments(script: str) -> list[list[str]]:
    """The MPMD segments of the script's mpirun line, each without its `-n 1`."""
    line = script[script.index("mpirun --allow-run-as-root") :].replace("\\\n", " ").split("\n")[0]
    argv = shlex.split(line.removesuffix(" &"))
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    segments, current = [], []
    for arg in argv[2:] + [":"]:
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
    scripts = _scripts(h200)
    assert list(scripts) == ["launch.sh"]
    script = scripts["launch.sh"]
    segments = _mpirun_segments(script)
    assert len(segments) == 9  # 1 orchestrator + prefill 1 x TP4 + decode 2 x TP2
    assert "One MPI world of 9 ranks" in script
    repo = "--model-repository=$MODEL_REPOSITORY"
    restricted = [f"--{flag}=model-repository,shared-memory,logging,trace:triton-admin-key=$ADMIN_KEY"
                  for flag in ("http-restricted-api", "grpc-restricted-protocol")]
    for rank, argv in enumerate(segments):
        assert argv[:2] == ["tritonserver", repo]
        assert "--disable-auto-complete-config" in argv
        # Only a server with ports has APIs to restrict: the repository API loads models sent with the request.
        tail = argv[-3:] if rank == 0 else [argv[-1], *restricted]
        assert tail == [f"--backend-config=python,shm-region-prefix-name=prefix{rank}_", *restricted]
    loads = [[a for a in argv if a.startswith("--load-model=")] for argv in segments]
    assert loads == [["--load-model=prefill", "--load-model=decode", "--load-model=decode_1"]] + \
        [["--load-model=prefill"]] * 4 + [["--load-model=decode"]] * 2 + [["--load-model=decode_1"]] * 2
    assert all("--model-control-mode=explicit" in argv for argv in segments)
    # Rank 0 serves the engines on loopback only; the workers serve nothing (launch_triton_server.py --multi-model).
    assert [a for a in segments[0] if "-port=" in a or "-address=" in a] == [
        "--http-port=8010", "--grpc-port=8011", "--metrics-port=8012",
        "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
    ]  # fmt: skip
    assert not any("-port=" in a for argv in segments[1:] for a in argv)
    # The front runs beside the MPI world, on the public ports, and loads no engine.
    front = shlex.split(next(line for line in script.splitlines() if line.startswith("tritonserver ")).removesuffix(" &"))
    assert [a for a in front if a.startswith("--load-model=") or "-port=" in a] == [
        "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--load-model=preprocessing",
        "--load-model=postprocessing", "--load-model=disagg_orchestrator", "--load-model=ensemble",
        "--load-model=tensorrt_llm_bls",  # the spec's orchestrator.bls: its front is sized for it
    ]  # fmt: skip
    assert not any("-address=" in a for a in front)
    assert front[-2:] == restricted
    assert 'ADMIN_KEY="${TRITON_ADMIN_KEY:-$(od -An -N16 -tx1 /dev/urandom | tr -d \' \\n\')}"' in script
    assert _exports(script) == {
        "DISAGG_ENGINE_URL": "http://127.0.0.1:8010",
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "0",  # 1.0 pins the MPI transceiver: no TRTLLM_USE_*_KVCACHE
        "UCX_MEMTYPE_CACHE": "n",
        "UCX_RNDV_FRAG_MEM_TYPES": "cuda",
        "UCX_RNDV_PIPELINE_ERROR_HANDLING": "y",
        "TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE": "0B",
    }


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_launch_scripts_are_valid_bash(h200, tmp_path):
    two_pools = example_spec("two-pools", model_dir(tmp_path))
    for spec in (h200, two_pools):
        for name, text in _scripts(spec).items():
            path = tmp_path / name
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize("release, exported", [("0.18", "1"), ("0.20", "1"), ("1.0", None)])
def test_kv_backend_selects_the_transceiver_where_the_release_reads_it_and_nvlink_is_optional(tmp_path, release, exported):
    def mpi_without_nvlink(raw):
        raw.update(trtllm_release=release)
        raw["kv_transfer"] = {"backend": "mpi", "nvlink": False}

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), mpi_without_nvlink)
    exports = _exports(_scripts(spec)["launch.sh"])
    assert exports.get("TRTLLM_USE_MPI_KVCACHE") == exported
    assert not any(k.startswith("UCX_") or k.startswith("TRTLLM_USE_UCX") for k in exports)
    assert f"(TensorRT-LLM {release}; images " in _scripts(spec)["launch.sh"]


def test_two_pools_get_one_script_and_world_each(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path))
    scripts = _scripts(spec)
    assert list(scripts) == ["launch-prefill-pool.sh", "launch-decode-pool.sh"]
    front, back = (_mpirun_segments(scripts[name]) for name in scripts)
    assert len(front) == len(back) == 9  # 1 + 4 x TP2, and 1 + 2 x TP4
    # Rank 0 of the first pool serves its engines on loopback, beside the front's own server; the decode
    # pool's serves its engines on 8001, where the front's orchestrator calls them.
    assert [a for a in front[0] if a.startswith(("--load-model=", "--grpc-port", "--grpc-address"))] == [
        "--grpc-port=8011", "--grpc-address=127.0.0.1", "--load-model=prefill", "--load-model=prefill_1",
        "--load-model=prefill_2", "--load-model=prefill_3",
    ]  # fmt: skip
    front_server = next(line for line in scripts["launch-prefill-pool.sh"].splitlines() if line.startswith("tritonserver "))
    assert [a for a in shlex.split(front_server) if a.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=postprocessing", "--load-model=disagg_orchestrator", "--load-model=ensemble",
    ]  # fmt: skip
    assert [a for a in back[0] if a.startswith(("--load-model=", "--grpc-port", "--grpc-address"))] == [
        "--grpc-port=8001", "--load-model=decode", "--load-model=decode_1",
    ]  # fmt: skip
    assert "exec mpirun" in scripts["launch-decode-pool.sh"] and "\ntritonserver " not in scripts["launch-decode-pool.sh"]
    assert "the orchestrator here reaches decode at decode-pool:8000, decode_1 at decode-pool:8000 over HTTP" in scripts["launch-prefill-pool.sh"]
    assert "calls this pool's models over HTTP at decode-pool:8000" in scripts["launch-decode-pool.sh"]
    assert _exports(scripts["launch-decode-pool.sh"])["TRTLLM_USE_UCX_KVCACHE"] == "1"
    assert "UCX_MEMTYPE_CACHE" not in _exports(scripts["launch-decode-pool.sh"])  # nvlink: false


def test_the_front_pool_orchestrator_calls_the_decode_pool_at_its_server(tmp_path):
    two_pools = example_spec("two-pools", model_dir(tmp_path))
    assert engine_urls(two_pools) == "decode=http://decode-pool:8000,decode_1=http://decode-pool:8000"
    orchestrator = next(m for m in plan_models(two_pools) if m.name == "disagg_orchestrator")
    assert parse_engine_urls(_params(_parse(orchestrator.config))["engine_urls"]) == {
        "decode": "http://decode-pool:8000", "decode_1": "http://decode-pool:8000"}
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
        _scripts(spec)
    with pytest.raises(SpecError, match=message):
        render_engine_configs(spec, "decode")
    with pytest.raises(SpecError, match=message):  # before any build work
        dry_run_lines(spec, ["prefill"])


def test_roles_must_share_the_kv_block_size(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path), lambda raw: raw["roles"]["decode"].update(tokens_per_block=64))
    with pytest.raises(SpecError, match=r"^roles\.decode\.tokens_per_block: 64 differs from roles\.prefill\.tokens_per_block=32"):
        render_engine_configs(spec, "prefill")


def test_node_names_must_be_host_names(tmp_path):
    spec = example_spec("two-pools", model_dir(tmp_path), lambda raw: raw["roles"]["decode"].update(node="decode pool"))
    with pytest.raises(SpecError, match=r"^roles\.decode\.node: 'decode pool' is not a host name"):
        _scripts(spec)


def test_engine_root_renders_paths_for_the_serving_host(tmp_path):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["output"].update(engine_root="/engines"))
    assert {name: _params(c)["gpt_model_path"] for name, c in _configs(spec, "decode").items()} == {
        "decode": "/engines/decode", "decode_1": "/engines/decode",
    }
    assert "need \"engine of model prefill (gpt_model_path)\" /engines/prefill/config.json" in _scripts(spec)["launch.sh"]
    with pytest.raises(SpecError, match=r"^output\.engine_root: 'engines' must be an absolute path"):
        example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["output"].update(engine_root="engines"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_launch_script_names_each_missing_path_before_starting(tmp_path):
    """Run where nothing exists: the script must stop before mpirun and name every missing path."""
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["output"].update(engine_root="/nonexistent/engines"))
    script = tmp_path / "launch" / "launch.sh"
    script.parent.mkdir()
    script.write_text(_scripts(spec)["launch.sh"])
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"launch.sh: model repository (MODEL_REPOSITORY) not found: {script.parent}/../model_repository",
        "launch.sh: engine of model prefill (gpt_model_path) not found: /nonexistent/engines/prefill/config.json",
        "launch.sh: engine of model decode (gpt_model_path) not found: /nonexistent/engines/decode/config.json",
        "launch.sh: engine of model decode_1 (gpt_model_path) not found: /nonexistent/engines/decode/config.json",
    ]
    (tmp_path / "model_repository").mkdir()
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "MODEL_REPOSITORY": str(tmp_path / "model_repository")})
    assert "model repository" not in run.stderr and run.returncode == 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("first_to_end", ["front", "engines"])
def test_launch_script_ends_the_deployment_when_either_server_ends(tmp_path, first_to_end):
    """With stand-ins for tritonserver and mpirun: the front and the MPI world start side by side, and
    whichever ends first takes the other down, with its exit code."""
    engine_root = tmp_path / "engines"
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["output"].update(engine_root=str(engine_root)))
    for role in ("prefill", "decode"):
        (engine_root / role).mkdir(parents=True)
        (engine_root / role / "config.json").write_text("{}")
    (tmp_path / "model_repository").mkdir()
    script = tmp_path / "launch" / "launch.sh"
    script.parent.mkdir()
    script.write_text(_scripts(spec)["launch.sh"])
    bin_dir, log = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir()
    for name, role in (("tritonserver", "front"), ("mpirun", "engines")):
        ends = "sleep 0.5; exit 7" if role == first_to_end else "exec sleep 60"
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{role} $$" >> {log}\n{ends}\n')
        (bin_dir / name).chmod(0o755)
    started = time.monotonic()
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert run.returncode == 7 and time.monotonic() - started < 10, run.stderr
    pids = dict(line.split() for line in log.read_text().splitlines())
    assert set(pids) == {"front", "engines"}
    time.sleep(0.2)
    running = [pid for pid in pids.values() if pid_alive(int(pid))]
    assert not running, "the other one was not ended"


def test_the_prefix_store_becomes_each_instances_host_offload_and_a_disk_tier_is_refused(tmp_path):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["roles"]["prefill"].update(kv_store_mb=512))
    assert _params(_configs(spec, "prefill")["prefill"])["kv_cache_host_memory_bytes"] == str(512 << 20)
    assert "kv_cache_host_memory_bytes" not in _params(_configs(spec, "decode")["decode"])
    with pytest.raises(SpecError, match=r"^roles\.prefill\.kv_store_disk_mb: the tensorrtllm backend has no disk tier"):
        example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["roles"]["prefill"].update(kv_store_mb=512, kv_store_disk_mb=4096))


def test_the_bls_is_served_by_the_front_beside_the_ensemble(tmp_path):
    """orchestrator.bls on a TensorRT-LLM spec: the front loads tensorrt_llm_bls, which reaches the same
    engine models as the ensemble's orchestrator."""
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw.setdefault("orchestrator", {}).update(bls=True))
    script = _scripts(spec)["launch.sh"]
    front = shlex.split(next(line for line in script.splitlines() if line.startswith("tritonserver ")).removesuffix(" &"))
    assert [a for a in front if a.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=postprocessing", "--load-model=disagg_orchestrator",
        "--load-model=ensemble", "--load-model=tensorrt_llm_bls",
    ]
    models = {m.name: _params(_parse(m.config)) for m in plan_models(spec)}
    for key in ("mode", "context_model_name", "generation_model_name", "engine_urls"):
        assert models["tensorrt_llm_bls"][key] == models["disagg_orchestrator"][key], key
