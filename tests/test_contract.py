"""One orchestrator for both backends: every tensor it sends to or reads from an engine slot has the
same name, type, shape and optionality in the reference engine's config and in the tensorrtllm config."""
from __future__ import annotations

import pytest
from google.protobuf import text_format
from trtllm_helpers import example_spec, model_dir
from tritonclient.grpc import model_config_pb2

from disagg.render import plan_models
from disagg.spec import load_spec
from disagg.triton.contract import FORWARDED_INPUTS, OUTPUTS_READ, SET_INPUTS
from disagg.trtllm.render import render_engine_config


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
    return {role: text_format.Parse(render_engine_config(spec, role), model_config_pb2.ModelConfig()) for role in ("prefill", "decode")}


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
