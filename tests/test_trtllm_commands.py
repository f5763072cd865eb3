"""Build commands as data (`--dry-run`), release detection, and build_roles against fake tools on PATH."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import stat
import textwrap

import pytest

from disagg.spec import SpecError
from disagg.trtllm import build, versions
from disagg.trtllm.commands import Command, role_commands
from trtllm_helpers import example_spec, model_dir

COMMON_BUILD_FLAGS = [
    "--kv_cache_type", "paged",
    "--gemm_plugin", "auto",
    "--gpt_attention_plugin", "auto",
    "--remove_input_padding", "enable",
    "--context_fmha", "enable",
]  # fmt: skip
CONVERT = "/app/examples/models/core/llama/convert_checkpoint.py"


@pytest.fixture(autouse=True)
def _default_examples_dir(monkeypatch):
    monkeypatch.delenv("TRTLLM_EXAMPLES_DIR", raising=False)


def _convert(model, role, tp, pp=1):
    return ["python3", CONVERT, "--model_dir", str(model), "--output_dir", f"build/trtllm/{role}/checkpoint",
            "--dtype", "bfloat16", "--tp_size", str(tp), "--pp_size", str(pp)]  # fmt: skip


def _build(role, batch, input_len, seq_len, num_tokens, workers, reuse):
    argv = ["trtllm-build", "--checkpoint_dir", f"build/trtllm/{role}/checkpoint", "--output_dir", f"build/engines/{role}",
            "--max_batch_size", str(batch), "--max_input_len", str(input_len), "--max_seq_len", str(seq_len),
            "--max_num_tokens", str(num_tokens), "--tokens_per_block", "32", *COMMON_BUILD_FLAGS]  # fmt: skip
    if reuse:
        argv += ["--use_paged_context_fmha", "enable"]
    return argv + ["--max_beam_width", "1", "--workers", str(workers)]


def test_dry_run_h200x8_intra_node(tmp_path):
    model = model_dir(tmp_path)
    spec = example_spec("h200x8-intra-node", model)
    lines = build.dry_run_lines(spec, ["prefill", "decode"])
    assert [shlex.split(line) for line in lines] == [
        _convert(model, "prefill", tp=4),
        _build("prefill", 8, 8192, 8193, 8192, workers=4, reuse=True),
        _convert(model, "decode", tp=2),
        _build("decode", 256, 8192, 10240, 256, workers=2, reuse=True),  # chunked context needs paged FMHA too
    ]


def test_dry_run_two_pools(tmp_path):
    model = model_dir(tmp_path)
    spec = example_spec("two-pools", model)
    lines = build.dry_run_lines(spec, ["decode", "prefill"])
    assert [shlex.split(line) for line in lines] == [
        _convert(model, "decode", tp=4),
        _build("decode", 512, 8192, 10240, 512, workers=4, reuse=True),
        _convert(model, "prefill", tp=2),
        _build("prefill", 8, 8192, 8193, 8192, workers=2, reuse=True),
    ]


def test_pipeline_parallel_and_local_gpus(tmp_path):
    def tp2_pp2(raw):
        raw["roles"]["prefill"].update(tp=2, pp=2)

    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), tp2_pp2)
    convert, trtllm_build = role_commands(spec, "prefill", local_gpus=2)
    assert convert.argv[-4:] == ("--tp_size", "2", "--pp_size", "2")
    assert trtllm_build.argv[-2:] == ("--workers", "2")  # capped by the build machine's GPUs


def test_examples_dir_and_layout_follow_the_release(tmp_path, monkeypatch):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path))
    monkeypatch.setenv("TRTLLM_EXAMPLES_DIR", "/opt/TensorRT-LLM/examples")
    assert role_commands(spec, "prefill")[0].argv[1] == "/opt/TensorRT-LLM/examples/models/core/llama/convert_checkpoint.py"
    def on_0_18(raw):
        raw.update(trtllm_release="0.18")
        raw["kv_transfer"]["backend"] = "mpi"

    old = role_commands(example_spec("h200x8-intra-node", model_dir(tmp_path), on_0_18), "prefill")[0]
    assert old.argv[1] == "/opt/TensorRT-LLM/examples/llama/convert_checkpoint.py"


def test_shell_quotes_what_needs_it():
    cmd = Command("prefill", "convert_checkpoint", ("python3", "convert.py", "--model_dir", "/models/my model"))
    assert cmd.shell() == "python3 convert.py --model_dir '/models/my model'"
    assert tuple(shlex.split(cmd.shell())) == cmd.argv


def test_unknown_role_and_reference_backend_are_rejected(tmp_path):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path))
    with pytest.raises(SpecError, match=r"^roles\.aggregated: not in the spec \(roles: prefill, decode\)"):
        build.dry_run_lines(spec, ["aggregated"])

    def reference(raw):
        raw.update(backend="reference")
        del raw["trtllm_release"]
        raw["model"]["dtype"] = "float32"

    with pytest.raises(SpecError, match=r"^backend: 'reference': TensorRT-LLM engines are built only"):
        build.dry_run_lines(example_spec("h200x8-intra-node", model_dir(tmp_path), reference), ["prefill"])


# --- release detection ---------------------------------------------------------------------------


def _installed(monkeypatch, version):
    def fake(name):
        assert name == "tensorrt_llm"
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", fake)


def test_detect_version_absent(monkeypatch):
    _installed(monkeypatch, None)
    with pytest.raises(RuntimeError) as err:
        versions.detect_version()
    message = str(err.value)
    assert message.startswith("TensorRT-LLM is not installed: ")
    assert "NGC container (nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3, <tag> one of 25.01, 25.02," in message
    assert "25.10, 25.11)" in message
    assert message.endswith("or use --dry-run to print the commands.")


@pytest.mark.parametrize("version", ["0.17.0", "0.17.0.post1", "0.18.2", "0.21.0", "1.0.0rc4", "1.0.3.2510"])
def test_detect_version_in_range(monkeypatch, version):
    _installed(monkeypatch, version)
    assert versions.detect_version() == version


@pytest.mark.parametrize("version", ["0.16.0", "1.1.0", "1.2.1", "2.0.0", "nightly"])
def test_detect_version_out_of_range(monkeypatch, version):
    _installed(monkeypatch, version)
    with pytest.raises(RuntimeError, match=rf"^TensorRT-LLM {version} is outside the supported range 0\.17 \.\. 1\.0: "):
        versions.detect_version()


def test_every_listed_image_is_in_range_and_the_target_is_the_newest():
    assert all(versions.find(f"{r.name}.0") is r for r in versions.RELEASES)
    assert versions.TARGET.image == "nvcr.io/nvidia/tritonserver:25.11-trtllm-python-py3"


def test_an_installed_release_other_than_the_specs_is_refused(tmp_path, monkeypatch):
    _installed(monkeypatch, "0.20.0")
    with pytest.raises(SpecError, match=r"^trtllm_release: '1\.0', but the installed TensorRT-LLM is 0\.20\.0"):
        build.pin_release(example_spec("h200x8-intra-node", model_dir(tmp_path)))
    unnamed = example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw.pop("trtllm_release"))
    assert build.pin_release(unnamed).trtllm_release == "0.20"  # a spec that names none gets the installed one
    assert build.pin_release(example_spec("two-pools", model_dir(tmp_path))).trtllm_release == "0.20"


# --- build_roles with fake tools -----------------------------------------------------------------

FAKE_CONVERT = """\
import argparse, json, pathlib
p = argparse.ArgumentParser()
for flag in ("--model_dir", "--output_dir", "--dtype"):
    p.add_argument(flag)
p.add_argument("--tp_size", type=int)
p.add_argument("--pp_size", type=int)
a = p.parse_args()
out = pathlib.Path(a.output_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps({"mapping": {"tp_size": a.tp_size, "pp_size": a.pp_size}}))
for rank in range(a.tp_size * a.pp_size):
    (out / f"rank{rank}.safetensors").write_bytes(b"")
print("converted", a.model_dir, "tp", a.tp_size)
"""
FAKE_BUILD_OK = """\
#!/usr/bin/env bash
while [ $# -gt 0 ]; do
  case "$1" in --checkpoint_dir) ckpt=$2; shift;; --output_dir) out=$2; shift;; esac; shift
done
mkdir -p "$out" && cp "$ckpt/config.json" "$out/config.json"
for f in "$ckpt"/rank*.safetensors; do : > "$out/$(basename "$f" .safetensors).engine"; done
echo "[TRT-LLM] [I] Total time of building all engines: 00:00:01"
"""
FAKE_BUILD_FAILS = """\
#!/usr/bin/env bash
for i in $(seq 1 30); do echo "build log line $i"; done
echo "[TensorRT-LLM][ERROR] CUDA out of memory" >&2
exit 3
"""


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """Fake converter under TRTLLM_EXAMPLES_DIR, fake trtllm-build first on PATH, TensorRT-LLM 1.0.0."""
    examples = tmp_path / "examples"
    script = examples / "models" / "core" / "llama" / "convert_checkpoint.py"
    script.parent.mkdir(parents=True)
    script.write_text(FAKE_CONVERT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("TRTLLM_EXAMPLES_DIR", str(examples))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    _installed(monkeypatch, "1.0.0")

    def install_trtllm_build(text):
        exe = bin_dir / "trtllm-build"
        exe.write_text(textwrap.dedent(text))
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)

    return install_trtllm_build


def _buildable_spec(tmp_path, edit=None):
    model = model_dir(tmp_path)
    shard = model / "model.safetensors"
    if not shard.exists():
        shard.write_bytes(b"weights")

    def edits(raw):
        raw["output"]["build_dir"] = str(tmp_path / "build")
        if edit:
            edit(raw)

    return example_spec("h200x8-intra-node", model, edits)


def test_build_roles_builds_then_skips_what_is_up_to_date(tmp_path, fake_tools, capsys):
    fake_tools(FAKE_BUILD_OK)
    spec = _buildable_spec(tmp_path)
    assert build.build_roles(spec, ["prefill", "decode"], force=False) == ["prefill", "decode"]
    out = capsys.readouterr().out
    assert "[prefill] convert_checkpoint rank 0-3 (TP 4 x PP 1)" in out
    assert "[prefill] trtllm-build rank 0-3 (TP 4 x PP 1)" in out
    assert "[decode] trtllm-build rank 0-1 (TP 2 x PP 1)" in out
    engines = tmp_path / "build" / "engines"
    assert sorted(p.name for p in (engines / "prefill").iterdir()) == [
        "config.json", "rank0.engine", "rank1.engine", "rank2.engine", "rank3.engine",
    ]  # fmt: skip
    manifest = json.loads((tmp_path / "build" / "trtllm" / "prefill" / "manifest.json").read_text())
    assert manifest["tensorrt_llm"] == "1.0.0"
    assert manifest["commands"] == build.dry_run_lines(spec, ["prefill"])  # dry-run prints what runs
    log = (tmp_path / "build" / "trtllm" / "prefill" / "build.log").read_text()
    assert "$ trtllm-build --checkpoint_dir" in log and "Total time of building all engines" in log

    assert build.build_roles(spec, ["prefill", "decode"], force=False) == []
    out = capsys.readouterr().out
    assert f"[prefill] up to date ({engines / 'prefill'})" in out
    assert "[decode] up to date" in out

    # A changed decode limit rebuilds decode only; force rebuilds everything.
    bigger = _buildable_spec(tmp_path, lambda raw: raw["roles"]["decode"].update(max_batch_size=128))
    assert build.build_roles(bigger, ["prefill", "decode"], force=False) == ["decode"]
    assert build.build_roles(bigger, ["prefill", "decode"], force=True) == ["prefill", "decode"]

    # New weights (a shard's mtime moves) rebuild both; a missing engine file rebuilds its role.
    shard = spec.model.path / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert build.build_roles(bigger, ["prefill", "decode"], force=False) == ["prefill", "decode"]
    (engines / "decode" / "rank1.engine").unlink()
    assert build.build_roles(bigger, ["prefill", "decode"], force=False) == ["decode"]


def test_build_failure_names_the_command_and_shows_the_log_tail(tmp_path, fake_tools):
    fake_tools(FAKE_BUILD_FAILS)
    spec = _buildable_spec(tmp_path)
    with pytest.raises(build.BuildError) as err:
        build.build_roles(spec, ["prefill", "decode"], force=False)
    message = str(err.value)
    failing = build.dry_run_lines(spec, ["prefill"])[1]
    assert message.startswith(f"[prefill] trtllm-build failed with exit code 3: {failing}\n")
    log = tmp_path / "build" / "trtllm" / "prefill" / "build.log"
    assert f"last 20 lines of {log}:" in message
    assert message.endswith("build log line 30\n[TensorRT-LLM][ERROR] CUDA out of memory")
    assert "build log line 12" in message and "build log line 11\n" not in message
    # It stopped there: no manifest for prefill, decode never started.
    assert not (tmp_path / "build" / "trtllm" / "prefill" / "manifest.json").exists()
    assert not (tmp_path / "build" / "trtllm" / "decode").exists()


def test_build_refuses_to_start_without_tensorrt_llm_or_its_tools(tmp_path, fake_tools, monkeypatch):
    spec = _buildable_spec(tmp_path)
    with pytest.raises(build.BuildError, match=r"trtllm-build not found on PATH"):
        build.build_roles(spec, ["prefill"], force=False)
    monkeypatch.setenv("TRTLLM_EXAMPLES_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(build.BuildError, match=r"convert_checkpoint\.py not found: set TRTLLM_EXAMPLES_DIR"):
        build.build_roles(spec, ["prefill"], force=False)
    _installed(monkeypatch, None)
    with pytest.raises(RuntimeError, match=r"^TensorRT-LLM is not installed"):
        build.build_roles(spec, ["prefill"], force=False)
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("name", ["h200x8-intra-node", "two-pools"])
def test_build_engines_dry_run_passes_on_both_example_specs(tmp_path, capsys, name):
    """The command a user runs, on the spec as shipped (its model path pointed at a Llama-3.1-8B config)."""
    import yaml

    from disagg.cli import main
    from trtllm_helpers import ROOT

    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    raw["model"]["path"] = str(model_dir(tmp_path))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(spec), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["python3", "trtllm-build"] * 2
    assert all("--use_paged_context_fmha enable" in line for line in lines if "decode" in line and line.startswith("trtllm-build"))


def test_the_documented_dry_run_is_what_the_shipped_spec_prints(capsys, monkeypatch):
    """docs/tensorrt-llm.md shows `build-engines --dry-run` of h200x8-intra-node: the lines printed from the spec as
    shipped, with the 8B model's config.json given (`--model-config`) since no checkpoint is at /models here."""
    import re

    from disagg.cli import main
    from trtllm_helpers import ROOT

    monkeypatch.chdir(ROOT)
    assert main(["--config", "configs/h200x8-intra-node.yaml", "--dry-run",
                 "--model-config", "configs/models/Llama-3.1-8B-Instruct.json"]) == 0
    printed = capsys.readouterr().out.splitlines()
    doc = (ROOT / "docs" / "tensorrt-llm.md").read_text()
    documented = re.search(r"checks that this block is what it prints\):\n\n```\n(.*?)\n```", doc, re.S).group(1).splitlines()
    assert printed == documented


def test_a_model_config_given_is_for_looking_only(tmp_path, capsys):
    """`--model-config` checks and plans a spec whose checkpoint is elsewhere; a build, which reads the checkpoint, refuses
    it by name before any work."""
    from disagg.cli import main
    from trtllm_helpers import LLAMA_3_1_8B_CONFIG, ROOT

    config = str(LLAMA_3_1_8B_CONFIG)
    spec = str(ROOT / "configs" / "h200x8-intra-node.yaml")
    assert main(["plan", "--config", spec, "--model-config", config]) == 0
    assert "8,030,261,248 parameters from config.json" in capsys.readouterr().out
    assert main(["--config", spec, "--model-config", config]) == 2
    assert capsys.readouterr().err == ("error: --model-config: for --dry-run, plan and manifests only: a build reads the "
                                       "checkpoint at model.path\n")
    assert main(["--config", spec]) == 2  # no checkpoint at /models here
    assert "model.path: /models/Llama-3.1-8B-Instruct has no config.json" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()
