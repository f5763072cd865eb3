"""What the orchestrator exchanges with an engine model, in one place.

Both engine slots (the reference engine's Python model and the tensorrtllm backend) must declare these
tensors with the same name, type and shape, and both must be decoupled: tests/test_contract.py checks
the rendered configs of both backends against this list.
"""
# Request tensors forwarded unchanged from the orchestrator's own inputs.
FORWARDED_INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "temperature", "runtime_top_k", "runtime_top_p", "seed")
# Tensors the orchestrator sets itself: streaming (always on towards engines), the handoff, cancellation.
SET_INPUTS = ("streaming", "context_phase_params", "stop")
OUTPUTS_READ = ("output_ids", "context_phase_params")
REQUEST_PARAMETERS = ("request_type",)
REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")
# The orchestrator calls the engine models over Triton's gRPC endpoint (not BLS: concurrent decoupled
# BLS streams crash Triton 2.51's python backend). disagg-serve sets this; default: the standard port.
ENGINE_URL_ENV = "DISAGG_ENGINE_GRPC_URL"
DEFAULT_ENGINE_URL = "127.0.0.1:8001"
