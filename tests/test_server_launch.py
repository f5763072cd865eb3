"""A real tritonserver serving the rendered front (preprocessing -> orchestrator -> postprocessing).

The orchestrator is replaced by an echo double that streams the prompt's own token ids back, so the
text must come back unchanged: tokenize -> ensemble plumbing -> incremental detokenize, end to end.
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from disagg.render import render_repository
from disagg.serve.server import ServerError, TritonServer, find_libpython, free_ports
from disagg.spec import load_spec
from tools.stream_client import StreamError, stream

pytestmark = pytest.mark.e2e

ECHO_ORCHESTRATOR = '''
"""Test double for disagg_orchestrator: streams the prompt's ids back, one token per response with up
to 3 earlier tokens as prefix (all at once when not streaming). max_tokens=1 instead answers with an
error listing the inputs it received, to check which optional ensemble inputs arrive."""
import numpy as np
import triton_python_backend_utils as pb_utils


def _value(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if _value(request, "request_output_len")[0] == 1:
                names = " ".join(sorted(t.name() for t in request.inputs()))
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"echo received: {names}")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            ids = _value(request, "input_ids").astype(np.int32)
            streaming = _value(request, "streaming")
            if streaming is not None and streaming[0]:
                windows = [(max(0, i - 3), i + 1) for i in range(len(ids))]
            else:
                windows = [(0, len(ids))]
            for start, end in windows:
                prefix = 0 if len(windows) == 1 else end - 1 - start
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("output_ids", ids[None, None, start:end]),
                    pb_utils.Tensor("sequence_length", np.array([[end - start]], dtype=np.int32)),
                    pb_utils.Tensor("prefix_length", np.array([[prefix]], dtype=np.int32)),
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

PROMPT = "Unicode: café 東京 🙂 — the quick brown fox"


@pytest.fixture(scope="module")
def front_repo(new_project) -> Path:
    """The cpu-tiny repository rendered with relative paths in a scratch project, echo orchestrator."""
    project = new_project("front")
    with contextlib.chdir(project):
        render_repository(load_spec("configs/cpu-tiny.yaml"), "model_repository")
    (project / "model_repository" / "disagg_orchestrator" / "1" / "model.py").write_text(ECHO_ORCHESTRATOR)
    return project / "model_repository"


@pytest.fixture(scope="module")
def server(start_triton, front_repo):
    # Explicit mode loads the ensemble and its steps only: the engine models are not needed here.
    s = start_triton(front_repo, "--model-control-mode=explicit", "--load-model=ensemble")
    yield s
    s.stop()


def test_prompt_streams_back_as_its_own_text(server):
    r = stream(server.grpc_url, "ensemble", PROMPT, max_tokens=16)
    assert r.text == PROMPT
    assert len(r.chunks) > 10 and "\ufffd" not in r.text  # split per token, multi-byte chars whole
    assert 0 < r.ttft <= r.timestamps[-1] and len(r.itl) >= 10


def test_non_streaming_returns_one_response(server):
    r = stream(server.grpc_url, "ensemble", PROMPT, max_tokens=16, streaming=False)
    assert r.chunks == (PROMPT,)


def test_optional_inputs_reach_the_orchestrator_only_when_sent(server):
    with pytest.raises(StreamError) as bare:
        stream(server.grpc_url, "ensemble", "hi", max_tokens=1)
    with pytest.raises(StreamError) as full:
        stream(server.grpc_url, "ensemble", "hi", max_tokens=1, temperature=0.5, top_k=5, top_p=0.9, seed=3,
               exclude_input_in_output=True)
    # preprocessing always sends end_id, pad_id, min_tokens (0: no minimum) and seed (0: TensorRT-LLM's default)
    always = "end_id input_ids input_lengths min_tokens pad_id request_output_len seed"
    assert bare.value.args[0].endswith(f"echo received: {always} streaming")
    assert full.value.args[0].endswith(
        "echo received: end_id exclude_input_in_output input_ids input_lengths min_tokens pad_id request_output_len "
        "runtime_top_k runtime_top_p seed streaming temperature"
    )


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ("", {}, "text_input: empty prompt"),
        (b"abc\xff", {}, "text_input: not valid UTF-8 (byte 0xff at offset 3)"),
        ("x" * 300, {}, "text_input: prompt is 300 tokens, over the limit max_input_len=256"),
        ("hello", {"max_tokens": 0}, "max_tokens: 0 must be >= 1"),
        ("hello", {"max_tokens": 5000}, "max_tokens: 5000 is over the limit 319"),
        ("hello", {"end_id": 600}, "end_id: 600 is outside the vocabulary (0..511) or -1 (no end token)"),
        ("hello", {"min_length": 9}, "min_length: 9 is over max_tokens=8"),
        ("hello", {"min_tokens": -2}, "min_tokens: -2 must be >= 0"),
        ("hello", {"min_tokens": 2, "min_length": 3},
         "min_length: 3 differs from min_tokens=2 (min_length is the older name of min_tokens; send one)"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(server, prompt, kwargs, message):
    kwargs = {"max_tokens": 8, **kwargs}
    with pytest.raises(StreamError) as err:
        stream(server.grpc_url, "ensemble", prompt, **kwargs)
    assert err.value.args[0] == f"in ensemble 'ensemble', {message}"
    assert stream(server.grpc_url, "ensemble", "still here", max_tokens=8).text == "still here"


def test_a_model_that_fails_to_load_fails_wait_ready_with_the_log(tmp_path):
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\n')
    (repo / "broken" / "1" / "model.py").write_text("raise ImportError('no such engine')\n")
    with pytest.raises(ServerError, match=r"(?s)exited with code \d+ before it was ready:\nerrors:\n.*failed to load 'broken'.*no such engine"):
        with TritonServer(repo, log_path=tmp_path / "log"):
            pass


def test_missing_libpython_names_the_debian_package(monkeypatch):
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    monkeypatch.setattr("sysconfig.get_config_var", lambda name: None)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(ServerError, match=rf"install the Debian package libpython{version} "):
        find_libpython(search_dirs=())


def test_disagg_serve_starts_prints_ready_and_exits_cleanly_on_sigterm(front_repo):
    """The server, then the OpenAI-compatible API on its own port; SIGTERM stops both."""
    http, grpc, metrics, openai_port = free_ports(4)
    launcher = Path(sys.executable).parent / "disagg-serve"
    proc = subprocess.Popen(
        [str(launcher), "--model-repository", str(front_repo), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--openai-port", str(openai_port), "--exit-timeout-secs=5",
         "--model-control-mode=explicit", "--load-model=postprocessing"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "disagg-serve: ready":
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "no 'ready' line:\n" + "".join(lines[-40:])
        assert any(f"listening on HTTP :{http}, gRPC :{grpc}, metrics :{metrics}" in line for line in lines)
        assert f"disagg-serve: OpenAI-compatible API on http://127.0.0.1:{openai_port}/v1\n" in lines
        with urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == ["ensemble", "aggregated"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-40:])
        with pytest.raises(urllib.error.URLError):  # the API went with the server
            urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/v1/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    from disagg.serve.server import _ephemeral_range

    ports = free_ports(8)
    assert len(set(ports)) == 8 and not any(p in _ephemeral_range() for p in ports)
    assert free_ports(0) == []
    left = set(free_ports(2))
    promised = set(range(10000, 65536)) - set(_ephemeral_range()) - left  # all but two: those are what is left
    assert set(free_ports(2, exclude=promised)) == left


def _deployment(repo: Path, *flags: str):
    from disagg.serve.launcher import Servers, _parser

    args, passthrough = _parser().parse_known_args(["--model-repository", str(repo), *flags])
    return Servers(args, passthrough, [])


def test_disagg_serve_runs_each_engine_model_in_a_server_of_its_own(cpu_tiny_project):
    from disagg.triton.contract import ENGINE_URLS_ENV

    d = _deployment(cpu_tiny_project / "model_repository")
    assert sorted(d.engines) == ["aggregated_engine", "decode", "prefill"]
    for name, sup in d.engines.items():
        assert sup.server.address == "127.0.0.1" and not sup.server.sweeps_deployment
        assert [a for a in sup.server.extra_args if a.startswith("--load-model")] == [f"--load-model={name}"]
    loads = {a.split("=", 1)[1] for a in d.main.server.extra_args if a.startswith("--load-model")}
    assert loads == {"aggregated", "aggregated_orchestrator", "disagg_orchestrator", "ensemble", "postprocessing", "preprocessing"}
    urls = dict(item.split("=") for item in d.main.server.env[ENGINE_URLS_ENV].split(","))
    assert urls == {name: f"http://{sup.server.http_url}" for name, sup in d.engines.items()}
    assert set(d.metrics_urls) == {"main", "aggregated_engine", "decode", "prefill"}


def test_one_server_or_a_model_control_mode_of_ones_own_keeps_everything_in_one_server(cpu_tiny_project):
    repo = cpu_tiny_project / "model_repository"
    one = _deployment(repo, "--one-server")
    assert one.engines == {} and "--load-model=*" in one.main.server.extra_args and one.main.server.sweeps_deployment
    own = _deployment(repo, "--model-control-mode=explicit", "--load-model=ensemble")
    assert own.engines == {} and [a for a in own.main.server.extra_args if "load-model" in a] == ["--load-model=ensemble"]


def test_config_auto_completion_is_off_unless_the_user_brings_models_that_may_need_it(cpu_tiny_project, tmp_path):
    repo = cpu_tiny_project / "model_repository"
    ours = _deployment(repo)
    assert not any(s.server.auto_complete for s in ours.supervised)
    strict = _deployment(repo, "--strict-model-config=false")
    assert strict.main.server.auto_complete and not any(s.server.auto_complete for s in strict.engines.values())
    (tmp_path / "theirs").mkdir()
    assert _deployment(repo, "--model-repository", str(tmp_path / "theirs")).main.server.auto_complete


def test_the_server_command_turns_config_auto_completion_off_unless_asked(tmp_path):
    from disagg.serve.server import ServerInstall

    def command(**kw):
        server = TritonServer(tmp_path, http_port=1, grpc_port=2, metrics_port=3, **kw)
        server.install = ServerInstall(Path("tritonserver"), None, {}, "test")
        return server.command()

    assert "--disable-auto-complete-config" in command()
    assert "--disable-auto-complete-config" not in command(auto_complete=True)


def test_the_server_command_collects_cpu_metrics_every_250_ms_unless_given_an_interval(tmp_path):
    """At Triton's default, 2000 ms, every stop took 0.7-0.9 s longer here: the collecting thread is joined at exit."""
    from disagg.serve.server import ServerInstall

    def intervals(*extra_args):
        server = TritonServer(tmp_path, http_port=1, grpc_port=2, metrics_port=3, extra_args=extra_args)
        server.install = ServerInstall(Path("tritonserver"), None, {}, "test")
        return [arg for arg in server.command() if arg.startswith("--metrics-interval-ms")]

    assert intervals() == ["--metrics-interval-ms=250"]
    assert intervals("--metrics-interval-ms=5000") == ["--metrics-interval-ms=5000"]


def test_the_exit_timeout_grows_with_the_instances_of_the_largest_python_model(tmp_path):
    """The Python backend unloads a model's instances one after another, 1.2 s apiece here: a stop of a model
    of five did not fit in 5 s, and tritonserver gave up on it and exited with 1."""
    from disagg.serve.server import ServerInstall, serial_unload_s

    def model(name: str, backend: str, groups: str, repository: Path = tmp_path) -> None:
        (repository / name).mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "{backend}"\n{groups}')

    model("engine", "python", "instance_group [ { count: 3 kind: KIND_CPU }, { kind: KIND_CPU } ]")  # 4 instances
    model("one", "python", "")
    model("onnx", "onnxruntime", "instance_group [ { count: 8 kind: KIND_CPU } ]")  # not the Python backend's
    model("one", "python", "instance_group [ { count: 1 kind: KIND_CPU } ]", tmp_path / "single")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("not a config")
    assert serial_unload_s(tmp_path) == 5  # 1.5 s for each of the three instances after the first
    server = TritonServer(tmp_path, http_port=1, grpc_port=2, metrics_port=3)
    server.install = ServerInstall(Path("tritonserver"), None, {}, "test")
    assert server.exit_timeout_s == 10 and "--exit-timeout-secs=10" in server.command()
    assert TritonServer(tmp_path, exit_timeout_s=None, http_port=1, grpc_port=2, metrics_port=3).exit_timeout_s is None
    assert TritonServer(tmp_path / "single", exit_timeout_s=5, http_port=1, grpc_port=2, metrics_port=3).exit_timeout_s == 5


def test_a_replica_needs_a_load_board_of_its_own(monkeypatch, capsys, tmp_path):
    from disagg.serve.launcher import main

    monkeypatch.delenv("DISAGG_LOAD_BOARD", raising=False)
    assert main(["--model-repository", str(tmp_path), f"--announce={tmp_path / 'registry'}"]) == 2
    assert "--announce: set DISAGG_LOAD_BOARD to a directory of this replica's own" in capsys.readouterr().err
    assert not (tmp_path / "registry").exists()
