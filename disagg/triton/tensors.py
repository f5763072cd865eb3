"""Reading an engine request (tensorrtllm backend names) into a plain `EngineCall`.

Kept free of Triton types beyond `get_input_tensor_by_name` so it is unit-testable with fakes.
Shapes: with max_batch_size > 0 every tensor has a leading batch dim of 1; scalars arrive as [1].
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from disagg.engine.engine import REQUEST_TYPES, RequestError
from disagg.engine.sampling import SamplingParams


@dataclass(frozen=True)
class EngineCall:
    request_id: str
    request_type: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    streaming: bool
    sampling: SamplingParams
    end_id: int | None
    stop: bool
    return_perf_metrics: bool
    context_phase_params: bytes | None


def _array(request, name: str, pb_utils):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name: str, pb_utils, default):
    arr = _array(request, name, pb_utils)
    if arr is None or arr.size == 0:
        return default
    return arr.reshape(-1)[0].item()


def request_type_of(request) -> str:
    params = json.loads(request.parameters() or "{}")
    value = params.get("request_type", "context_and_generation")
    if value not in REQUEST_TYPES:
        raise RequestError(f"request_type: {value!r} is not one of {', '.join(REQUEST_TYPES)}")
    return value


def parse_engine_call(request, pb_utils) -> EngineCall:
    stop = bool(_scalar(request, "stop", pb_utils, False))
    ids = _array(request, "input_ids", pb_utils)
    ids = () if ids is None else tuple(int(t) for t in ids.reshape(-1))
    length = int(_scalar(request, "input_lengths", pb_utils, len(ids)))
    if not stop and not 0 <= length <= len(ids):
        raise RequestError(f"input_lengths: {length} does not fit input_ids of {len(ids)} tokens")
    params_blob = _array(request, "context_phase_params", pb_utils)
    return EngineCall(
        request_id=request.request_id(),
        request_type=request_type_of(request),
        input_ids=ids[:length],
        max_new_tokens=int(_scalar(request, "request_output_len", pb_utils, 0)),
        streaming=bool(_scalar(request, "streaming", pb_utils, False)),
        sampling=SamplingParams(
            temperature=float(_scalar(request, "temperature", pb_utils, 1.0)),
            top_k=int(_scalar(request, "runtime_top_k", pb_utils, 0)),
            top_p=float(_scalar(request, "runtime_top_p", pb_utils, 0.0)),
            seed=int(_scalar(request, "seed", pb_utils, 0)),
            min_tokens=int(_scalar(request, "min_tokens", pb_utils, 0)),
        ),
        end_id=_scalar(request, "end_id", pb_utils, None),
        stop=stop,
        return_perf_metrics=bool(_scalar(request, "return_perf_metrics", pb_utils, False)),
        context_phase_params=None if params_blob is None else params_blob.astype("uint8").tobytes(),
    )
