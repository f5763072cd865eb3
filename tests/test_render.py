"""The rendered Triton model repository: valid ModelConfigs, the contract's fields, relative paths."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.render import render_repository
from disagg.repository import RenderError, parse_config, render_template
from disagg.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "preprocessing", "postprocessing", "prefill", "decode", "aggregated_engine",
    "disagg_orchestrator", "aggregated_orchestrator", "ensemble", "aggregated",
}
ENGINES = ("prefill", "decode", "aggregated_engine")
ORCHESTRATORS = ("disagg_orchestrator", "aggregated_orchestrator")


@pytest.fixture(scope="module")
def spec():
    return load_spec(ROOT / "configs" / "cpu-tiny.yaml")


@pytest.fixture(scope="module")
def repo(spec, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("render") / "model_repository"
    render_repository(spec, out)
    return out


def config(repo: Path, model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def params(cfg: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_every_model_is_rendered_and_parses(repo):
    assert {p.name for p in repo.iterdir()} == MODELS
    for model in MODELS:
        assert config(repo, model).name == model


def test_python_models_get_a_shim_and_ensembles_a_version_dir(repo):
    assert (repo / "prefill" / "1" / "model.py").read_text().endswith(
        "from disagg.triton.engine_model import TritonPythonModel  # noqa: F401\n"
    )
    assert "from disagg.triton.orchestrator import" in (repo / "aggregated_orchestrator" / "1" / "model.py").read_text()
    assert "from disagg.triton.preprocessing import" in (repo / "preprocessing" / "1" / "model.py").read_text()
    assert [p.name for p in (repo / "ensemble" / "1").iterdir()] == [".gitkeep"]


def test_no_python_model_behind_the_dynamic_batcher(spec, tmp_path):
    """With dynamic batching in front of decoupled Python models, Triton 2.51 servers aborted on a corrupted heap
    after 3-12 minutes of load; without it in any, they did not (README, Known problems)."""
    out = tmp_path / "model_repository"
    render_repository(dataclasses.replace(spec, orchestrator=dataclasses.replace(spec.orchestrator, bls=True)), out)
    python = [cfg for cfg in (config(out, d.name) for d in out.iterdir()) if cfg.backend == "python"]
    assert {cfg.name for cfg in python} == MODELS - {"ensemble", "aggregated"} | {"tensorrt_llm_bls"}
    assert [cfg.name for cfg in python if cfg.HasField("dynamic_batching")] == []


def test_decoupled_exactly_where_responses_stream(repo):
    decoupled = {m for m in MODELS if config(repo, m).model_transaction_policy.decoupled}
    assert decoupled == {*ENGINES, *ORCHESTRATORS}
    assert config(repo, "ensemble").platform == config(repo, "aggregated").platform == "ensemble"


def test_engine_models_follow_the_tensorrtllm_contract(repo, spec):
    for model, role in zip(ENGINES, ("prefill", "decode", "aggregated")):
        cfg = config(repo, model)
        assert cfg.backend == "python" and cfg.max_batch_size == spec.roles[role].max_batch_size
        assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
        inputs = {t.name: t for t in cfg.input}
        assert {n for n, t in inputs.items() if not t.optional} == {"input_lengths", "request_output_len"}
        assert inputs["input_ids"].allow_ragged_batch and list(inputs["input_ids"].dims) == [-1]
        cpp = inputs["context_phase_params"]
        assert (cpp.data_type, list(cpp.dims), cpp.allow_ragged_batch) == (model_config_pb2.TYPE_UINT8, [-1], True)
        for name in ("input_lengths", "end_id", "streaming", "temperature", "runtime_top_k", "seed", "stop"):
            assert list(inputs[name].dims) == [1] and inputs[name].HasField("reshape") and not inputs[name].reshape.shape
        types = {t.name: model_config_pb2.DataType.Name(t.data_type) for t in cfg.input}
        assert (types["seed"], types["streaming"], types["runtime_top_p"]) == ("TYPE_UINT64", "TYPE_BOOL", "TYPE_FP32")
        outputs = {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in cfg.output}
        assert outputs["output_ids"] == ("TYPE_INT32", [-1, -1])
        assert outputs["context_phase_params"] == ("TYPE_UINT8", [-1])
        assert outputs["first_token_time_ns"] == ("TYPE_INT64", [1])
        assert outputs["kv_cache_reused_blocks"] == ("TYPE_INT32", [1])
        assert params(cfg) == {
            "engine_dir": f"../build/engines/{role}", "role": role,
            "kv_transfer_backend": "shm", "kv_lease_seconds": "30", "kv_bind_address": "127.0.0.1", "kv_store_bytes": "0", "kv_store_disk_bytes": "0", "kv_store_disk_dir": "",
        }


def test_orchestrators_and_front_parameters(repo):
    disagg, agg = params(config(repo, "disagg_orchestrator")), params(config(repo, "aggregated_orchestrator"))
    common = {"prefill_timeout_s": "30", "decode_timeout_s": "120", "max_in_flight": "64", "prefill_routing": "cache_aware", "coalesce_backlog": "0", "engine_urls": "", "engine_input_names": "",
              "service_classes": "{}", "default_service_class": "", "pool_routing": "service_class"}
    assert disagg == {"mode": "disaggregated", "context_model_name": "prefill", "generation_model_name": "decode", **common}
    assert agg == {"mode": "aggregated", "aggregated_model_name": "aggregated_engine", **common}
    cfg = config(repo, "disagg_orchestrator")
    assert [t.name for t in cfg.output] == ["output_ids", "sequence_length", "prefix_length", "is_final", "stream_id"]
    # Scalars arrive as [batch, 1] and go to the engines unchanged (no reshape here, unlike the engines).
    assert {t.name for t in cfg.input} == {
        "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "streaming", "temperature",
        "runtime_top_k", "runtime_top_p", "seed", "min_tokens", "exclude_input_in_output", "service_class",
    }
    assert not any(t.HasField("reshape") for t in cfg.input)
    assert params(config(repo, "preprocessing")) == {
        "tokenizer_dir": "../build/checkpoints/tiny-llama", "max_input_len": "256", "max_output_len": "319",
        "max_seq_len": "320", "add_special_tokens": "true",
    }
    assert params(config(repo, "postprocessing")) == {
        "tokenizer_dir": "../build/checkpoints/tiny-llama", "skip_special_tokens": "true",
    }


# The inputs of upstream's ensemble (tensorrtllm_backend all_models/inflight_batcher_llm/ensemble/config.pbtxt)
# with their types, read at v0.17.0 and v0.19.0 (old names) and at commit c2e65b8 (new names).
UPSTREAM_ENSEMBLE_INPUTS = {
    "text_input": "STRING", "max_tokens": "INT32", "num_return_sequences": "INT32", "bad_words": "STRING",
    "stop_words": "STRING", "exclude_input_in_output": "BOOL", "end_id": "INT32", "pad_id": "INT32", "top_k": "INT32",
    "top_p": "FP32", "temperature": "FP32", "length_penalty": "FP32", "repetition_penalty": "FP32",
    "presence_penalty": "FP32", "frequency_penalty": "FP32", "return_log_probs": "BOOL", "return_context_logits": "BOOL",
    "return_generation_logits": "BOOL", "beam_width": "INT32", "stream": "BOOL",
    "min_length": "INT32", "random_seed": "UINT64", "return_kv_cache_reuse_stats": "BOOL",  # v0.17.0 (v0.19.0: return_perf_metrics)
    "min_tokens": "INT32", "seed": "UINT64", "return_perf_metrics": "BOOL",  # c2e65b8 on
    # for what these engines are not built to do: declared, refused unless empty (preprocessing, REFUSED)
    "decoder_text_input": "STRING", "prompt_embedding_table": "FP16", "prompt_table_extra_id": "UINT64",
    "prompt_vocab_size": "INT32", "embedding_bias_words": "STRING", "embedding_bias_weights": "FP32",
    "lora_task_id": "UINT64", "lora_weights": "FP16", "lora_config": "INT32",
    "guided_decoding_guide_type": "STRING", "guided_decoding_guide": "STRING",  # v0.19.0 on
}  # fmt: skip


def test_ensembles_declare_upstreams_inputs_and_each_reaches_a_model(repo):
    """perf_analyzer / genai-perf refuse an input the model does not declare; one declared but mapped to no
    step would be silently ignored."""
    for ensemble in ("ensemble", "aggregated"):
        cfg = config(repo, ensemble)
        declared = {t.name: model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_") for t in cfg.input}
        assert declared == {**UPSTREAM_ENSEMBLE_INPUTS, "service_class": "STRING"}  # ours: disagg.triton.sla
        assert {t.name for t in cfg.input if not t.optional} == {"text_input", "max_tokens"}
        assert {t.name: list(t.dims) for t in cfg.input if list(t.dims) != [1]} == {
            "stop_words": [-1], "bad_words": [-1], "prompt_embedding_table": [-1, -1], "embedding_bias_words": [-1],
            "embedding_bias_weights": [-1], "lora_weights": [-1, -1], "lora_config": [-1, 3]}
        mapped = {value for step in cfg.ensemble_scheduling.step for value in step.input_map.values()}
        assert set(declared) <= mapped
        for step in cfg.ensemble_scheduling.step:  # each goes to an input of that type the step's model declares
            inputs = {t.name: model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_") for t in config(repo, step.model_name).input}
            for key, value in step.input_map.items():
                assert key in inputs, (step.model_name, key)
                assert value not in declared or inputs[key] == declared[value], (step.model_name, key)


def test_ensembles_wire_preprocessing_orchestrator_postprocessing(repo):
    checked = ("num_return_sequences", "length_penalty", "repetition_penalty", "min_tokens", "min_length", "presence_penalty",
               "frequency_penalty", "seed", "random_seed", "return_log_probs", "return_context_logits", "return_generation_logits",
               "return_perf_metrics", "return_kv_cache_reuse_stats", "beam_width")
    not_built = ("prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id", "embedding_bias_words",
                 "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
                 "guided_decoding_guide")
    for ensemble, orchestrator in (("ensemble", "disagg_orchestrator"), ("aggregated", "aggregated_orchestrator")):
        cfg = config(repo, ensemble)
        assert [t.name for t in cfg.output] == ["text_output", "num_output_tokens"] and cfg.max_batch_size > 0
        steps = [(s.model_name, dict(s.input_map), dict(s.output_map)) for s in cfg.ensemble_scheduling.step]
        assert [s[0] for s in steps] == ["preprocessing", orchestrator, "postprocessing"]
        assert steps[0][1] == {
            "QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id",
            **{name.upper(): name for name in checked}, "STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words",
            "DECODER_QUERY": "decoder_text_input", **{name.upper(): name for name in not_built},
        }
        assert steps[1][1] == {
            "input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
            "end_id": "_END_ID", "pad_id": "_PAD_ID", "streaming": "stream", "temperature": "temperature",
            "runtime_top_k": "top_k", "runtime_top_p": "top_p", "seed": "_SEED", "min_tokens": "_MIN_TOKENS",
            "exclude_input_in_output": "exclude_input_in_output", "service_class": "service_class",
        }
        assert steps[0][2] == {
            "INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
            "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID", "OUT_MIN_TOKENS": "_MIN_TOKENS", "OUT_SEED": "_SEED",
        }
        tokens = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH", "PREFIX_LENGTH": "_PREFIX_LENGTH",
                  "IS_FINAL": "_IS_FINAL", "STREAM_ID": "_STREAM_ID"}
        assert steps[1][2] == {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
                               "prefix_length": "_PREFIX_LENGTH", "is_final": "_IS_FINAL", "stream_id": "_STREAM_ID"}
        assert (steps[2][1], steps[2][2]) == (tokens, {"OUTPUT": "text_output", "NUM_OUTPUT_TOKENS": "num_output_tokens"})


def test_output_is_deterministic_and_machine_independent(spec, repo, tmp_path):
    assert render_repository(spec, repo) == []  # up to date: nothing rewritten
    again = tmp_path / "elsewhere" / "model_repository"
    render_repository(spec, again)
    files = sorted(p.relative_to(repo) for p in repo.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        text = (repo / f).read_text()
        assert text == (again / f).read_text()
        assert str(ROOT) not in text and str(tmp_path.parent) not in text and '"/' not in text


def test_front_limits_hold_for_every_path(spec, tmp_path):
    roles = dict(spec.roles)
    roles["aggregated"] = dataclasses.replace(roles["aggregated"], max_input_len=128, max_seq_len=200)
    render_repository(dataclasses.replace(spec, roles=roles), tmp_path)
    p = params(config(tmp_path, "preprocessing"))
    assert (p["max_input_len"], p["max_output_len"], p["max_seq_len"]) == ("128", "199", "200")


def test_aggregated_only_spec_renders_the_baseline_path(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "cpu-tiny.yaml").read_text())
    del raw["roles"]["prefill"], raw["roles"]["decode"]
    render_repository(parse_spec(raw), tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        "preprocessing", "postprocessing", "aggregated_engine", "aggregated_orchestrator", "aggregated",
    }


def test_tensorrt_llm_spec_gets_tensorrtllm_engines_and_launch_files(tmp_path):
    spec = parse_spec(yaml.safe_load((ROOT / "configs" / "h200x8-intra-node.yaml").read_text()))
    out = tmp_path / "model_repository"
    render_repository(spec, out)
    assert config(out, "prefill").backend == config(out, "decode").backend == "tensorrtllm"
    assert (out / "prefill" / "1" / ".gitkeep").is_file() and not (out / "prefill" / "1" / "model.py").exists()
    assert (tmp_path / "launch" / "launch.sh").is_file()
    assert config(out, "ensemble").ensemble_scheduling.step[1].model_name == "disagg_orchestrator"


def test_missing_template_variable_is_an_error():
    with pytest.raises(jinja2.UndefinedError, match="'module' is undefined"):
        render_template("model.py.j2", name="x")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name: "prefill"\nmax_batch_size: "four"\n', "model 'prefill': config.pbtxt is not a valid Triton ModelConfig"),
        ('name: "prefill"\nbogus_field: 1\n', "model 'prefill': config.pbtxt is not a valid Triton ModelConfig"),
        ('name: "prefill"\nparameters { key: "x" value: { string_value: "${x}" } }\n', "unfilled"),
        ('name: "decode"\n', "model 'prefill': config.pbtxt names the model 'decode'"),
    ],
)
def test_invalid_config_names_the_model(text, message):
    with pytest.raises(RenderError, match=message.replace("(", r"\(")):
        parse_config("prefill", text)


def test_committed_model_repository_is_the_rendering_of_cpu_tiny(tmp_path):
    """model_repository/ in git must be exactly what build-engines renders for configs/cpu-tiny.yaml."""
    committed = Path("model_repository")
    render_repository(load_spec("configs/cpu-tiny.yaml"), tmp_path / "model_repository")
    fresh = {p.relative_to(tmp_path / "model_repository"): p.read_text() for p in (tmp_path / "model_repository").rglob("*") if p.is_file()}
    in_git = {p.relative_to(committed): p.read_text() for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(in_git) == sorted(fresh), "files differ: re-run build-engines --config configs/cpu-tiny.yaml and commit"
    for rel, text in fresh.items():
        assert in_git[rel] == text, f"model_repository/{rel} drifted from its rendering: re-run build-engines and commit"
