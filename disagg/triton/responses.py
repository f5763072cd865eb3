"""Sending a response with tensors from a decoupled Python model, safely on the Triton release we run.

Triton 2.51's Python backend (python_backend r24.10, src/response_sender.cc `ResponseSender::Send`) releases
the GIL and then drops the outputs the request did not ask for (`InferResponse::PruneOutputTensors`). Where
the response held the last reference to such a tensor, its numpy array was freed there, without the GIL,
while the model's other threads ran Python: the stub's heap broke (a segfault in libpython's allocator), and
sometimes the server with it (`boost::interprocess::lock_exception`, Signal 6). An engine model's responses
carry `sequence_length`, which the orchestrator does not ask for, so every hop took that path. Upstream fixed
it after 2.51 (python_backend #390: PbTensor's destructor takes the GIL). Here the caller's tensors are held
until the send has returned, so what the backend drops is never the last reference.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils


def send(sender, outputs: list, flags: int = 0) -> None:
    """One response of `outputs` (pb_utils.Tensor), held by this frame while Triton sends it."""
    sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
