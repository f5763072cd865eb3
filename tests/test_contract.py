"""One orchestrator for both backends: every tensor it sends to or reads from an engine slot has the
same name, type, shape and optionality in the reference engine's config and in the tensorrtllm config."""
from __future__ import annotations

import pytest
from google.protobuf import text_format
from trtllm_helpers import example_spec, model_dir
from tritonclient.grpc import model_config_pb2

from disagg.render import plan_models
from disagg.spec import SpecError, load_spec
from disagg.triton.contract import FORWARDED_INPUTS, OUTPUTS_READ, SET_INPUTS, parse_input_names, rename_inputs
from disagg.trtllm import versions
from disagg.trtllm.build import dry_run_lines
from disagg.trtllm.render import render_engine_configs


def _signature(tensor) -> tuple:
    return (
        model_config_pb2.DataType.Name(tensor.data_type),
        tuple(tensor.dims),
        tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None,
    )


def _io(config: model_config_pb2.ModelConfig) -> tuple[dict, dict]:
    return {t.name: t for t in config.input}, {t.name: t for t in config.output}


@pytest.fixture(scope="module")
def reference() -> dict[str, model_config_pb2.ModelConfig]:
    spec = load_spec("configs/cpu-tiny.yaml")
    return {m.name: text_format.Parse(m.config, model_config_pb2.ModelConfig()) for m in plan_models(spec)}


@pytest.fixture(scope="module")
def tensorrtllm(tmp_path_factory) -> dict[str, model_config_pb2.ModelConfig]:
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path_factory.mktemp("llama")))
    return {role: text_format.Parse(render_engine_configs(spec, role)[role], model_config_pb2.ModelConfig()) for role in ("prefill", "decode")}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_exchanged_tensor_matches_across_backends(reference, tensorrtllm, role):
    ref_in, ref_out = _io(reference[role])
    trt_in, trt_out = _io(tensorrtllm[role])
    orchestrator_in, _ = _io(reference["disagg_orchestrator"])
    for name in (*FORWARDED_INPUTS, *SET_INPUTS):
        assert name in ref_in and name in trt_in, f"{role}: input {name!r} missing"
        assert _signature(ref_in[name]) == _signature(trt_in[name]), f"{role}: input {name!r} differs"
        assert ref_in[name].optional == trt_in[name].optional, f"{role}: input {name!r} optionality differs"
        assert ref_in[name].allow_ragged_batch == trt_in[name].allow_ragged_batch, name
    for name in FORWARDED_INPUTS:  # what the orchestrator forwards, it receives with the same type
        assert model_config_pb2.DataType.Name(orchestrator_in[name].data_type) == model_config_pb2.DataType.Name(ref_in[name].data_type), name
    for name in OUTPUTS_READ:
        assert name in ref_out and name in trt_out, f"{role}: output {name!r} missing"
        assert _signature(ref_out[name]) == _signature(trt_out[name]), f"{role}: output {name!r} differs"
    assert reference[role].model_transaction_policy.decoupled and tensorrtllm[role].model_transaction_policy.decoupled


def test_contract_types_are_the_tensorrtllm_backends(tensorrtllm):
    inputs, outputs = _io(tensorrtllm["decode"])
    assert _signature(inputs["input_ids"]) == ("TYPE_INT32", (-1,), None)
    assert _signature(inputs["request_output_len"]) == ("TYPE_INT32", (1,), ())
    assert _signature(inputs["context_phase_params"]) == ("TYPE_UINT8", (-1,), None)
    assert _signature(inputs["stop"]) == ("TYPE_BOOL", (1,), ())
    assert _signature(outputs["output_ids"]) == ("TYPE_INT32", (-1, -1), None)


# -- per TensorRT-LLM release --------------------------------------------------------------------------
def _on(release: str):
    def edit(raw):
        raw["trtllm_release"] = release
        raw["kv_transfer"]["backend"] = "mpi"  # every release has it, in one MPI world

    return edit


@pytest.mark.parametrize("release", [r.name for r in versions.RELEASES])
def test_each_release_gets_the_input_names_it_reads_and_the_orchestrator_sends_them(tmp_path, release):
    spec = example_spec("h200x8-intra-node", model_dir(tmp_path), _on(release))
    models = {m.name: text_format.Parse(m.config, model_config_pb2.ModelConfig()) for m in plan_models(spec)}
    declared = {t.name for t in models["decode"].input}
    old = release in ("0.17", "0.18")
    assert ("random_seed" in declared, "seed" in declared) == (old, not old)
    assert ("min_length" in declared, "min_tokens" in declared) == (old, not old)
    assert ("return_kv_cache_reuse_stats" in declared, "return_perf_metrics" in declared) == (old, not old)
    names = parse_input_names(models["disagg_orchestrator"].parameters["engine_input_names"].string_value)
    sent = rename_inputs(dict.fromkeys((*FORWARDED_INPUTS, *SET_INPUTS)), names)
    assert set(sent) <= declared, f"{release}: the orchestrator would send {set(sent) - declared}, which the engine does not read"
    assert ("random_seed" in sent) == old


def test_rename_inputs_is_what_the_orchestrator_applies():
    arrays = {"seed": 1, "input_ids": 2}
    assert rename_inputs(arrays, parse_input_names("seed=random_seed,min_tokens=min_length")) == {"random_seed": 1, "input_ids": 2}
    assert rename_inputs(arrays, parse_input_names("")) == arrays
    with pytest.raises(ValueError, match="engine_input_names: 'seed' is not name=engine_name"):
        parse_input_names("seed")


@pytest.mark.parametrize(
    ("spec_name", "edit", "message"),
    [
        ("h200x8-intra-node", lambda raw: raw.update(trtllm_release="0.17") or raw["kv_transfer"].update(backend="ucx"),
         r"^kv_transfer\.backend: 'ucx' does not work with TensorRT-LLM 0\.17 \(trtllm_release\): its cache transceiver has mpi only \(UCX came in 0\.19\); use mpi, or a release that has ucx: 0\.19, 0\.20$"),
        ("h200x8-intra-node", lambda raw: raw["kv_transfer"].update(backend="ucx"),
         r"^kv_transfer\.backend: 'ucx' does not work with TensorRT-LLM 1\.0 \(trtllm_release\): its Triton backend sets the MPI cache transceiver itself and ignores TRTLLM_USE_\*_KVCACHE \(TensorRT-LLM PR #5234\); use mpi, or a release that has ucx: 0\.19, 0\.20$"),
        ("two-pools", lambda raw: raw.update(trtllm_release="1.0") or raw["kv_transfer"].update(backend="mpi"),
         r"^kv_transfer\.backend: 'mpi' needs prefill and decode in one MPI world, but roles run on nodes prefill-pool, decode-pool \(one world per pool\): TensorRT-LLM 1\.0 has no other transport in Triton; set trtllm_release to 0\.19 or 0\.20 and use ucx between the pools, or put both roles on one node$"),
        ("two-pools", lambda raw: raw.update(trtllm_release="0.20") or raw["kv_transfer"].update(backend="mpi"),
         r"^kv_transfer\.backend: 'mpi' needs prefill and decode in one MPI world, .*: use ucx$"),
        ("h200x8-intra-node", lambda raw: raw.update(trtllm_release="0.16"),
         r"^trtllm_release: '0\.16' is not a supported TensorRT-LLM release line \(supported: 0\.17, 0\.18, 0\.19, 0\.20, 0\.21, 1\.0\)$"),
    ],
)  # fmt: skip
def test_what_a_release_cannot_serve_is_refused_before_any_work(tmp_path, spec_name, edit, message):
    spec = example_spec(spec_name, model_dir(tmp_path), edit)
    with pytest.raises(SpecError, match=message):
        dry_run_lines(spec, list(spec.roles))
    with pytest.raises(SpecError, match=message):
        plan_models(spec)


def test_decode_without_chunked_context_must_fit_its_prompts_in_one_step(tmp_path):
    """TensorRT-LLM checks generation-only prompts against min(max_seq_len - 1, max_num_tokens) too."""
    with pytest.raises(SpecError, match=r"^roles\.decode\.max_num_tokens: 256 is below max_input_len=8192: without chunked context .* set roles\.decode\.enable_chunked_context: true or raise max_num_tokens$"):
        example_spec("h200x8-intra-node", model_dir(tmp_path), lambda raw: raw["roles"]["decode"].pop("enable_chunked_context"))
    config = {n: text_format.Parse(c, model_config_pb2.ModelConfig()) for n, c in render_engine_configs(example_spec("h200x8-intra-node", model_dir(tmp_path)), "decode").items()}
    assert config["decode"].parameters["enable_chunked_context"].string_value == "true"
