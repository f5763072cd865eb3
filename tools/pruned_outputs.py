"""Shows the Triton 2.51 stub crash that disagg.triton.responses avoids, on the server this project runs.

A decoupled Python model streams responses of 65 outputs while the client asks for one; a second thread of
the model allocates Python objects all the while, as an engine model's other threads (requests arriving,
metrics, KV transfers) do. Triton's `ResponseSender::Send` drops the 64 outputs not asked for with the GIL
released. Run twice on a fresh server each time:

    dropped   the response holds the last reference to its tensors (the engine model's way until this fix)
    held      the model holds them until `send` returns (disagg.triton.responses.send)

and prints how many responses each served before its stub died, if it did. Bounded: `--responses` per way,
`--timeout` seconds without a response ends a way.

    python tools/pruned_outputs.py
"""
from __future__ import annotations

import argparse
import os
import queue
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from disagg.serve.server import TritonServer

DROPPED = 64
CONFIG = """name: "pruned"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ASKED" data_type: TYPE_INT32 dims: [ -1 ] }, %s ]
""" % ", ".join(f'{{ name: "DROPPED{i}" data_type: TYPE_INT32 dims: [ -1 ] }}' for i in range(DROPPED))
MODEL = f"""import os, threading
import numpy as np
import triton_python_backend_utils as pb_utils

HELD = os.environ["PRUNED_HELD"] == "1"


class TritonPythonModel:
    def initialize(self, args):
        self.stopped = threading.Event()
        threading.Thread(target=self._allocate, daemon=True).start()

    def _allocate(self):
        while not self.stopped.is_set():
            [np.arange(i % 7 + 1) for i in range(200)]

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self._stream, args=(request.get_response_sender(), n), daemon=True).start()

    def _stream(self, sender, n):
        for _ in range(n):
            outputs = [pb_utils.Tensor("ASKED", np.arange(3, dtype=np.int32))]
            outputs += [pb_utils.Tensor(f"DROPPED{{i}}", np.arange(5, dtype=np.int32)) for i in range({DROPPED})]
            response = pb_utils.InferenceResponse(output_tensors=outputs)
            if not HELD:
                del outputs
            sender.send(response)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self.stopped.set()
"""


def serve(repository: Path, held: bool, responses: int, timeout_s: float) -> tuple[int, str | None]:
    """Responses received and the error that ended the run early, if one did."""
    os.environ["PRUNED_HELD"] = "1" if held else "0"
    got: queue.SimpleQueue = queue.SimpleQueue()
    with TritonServer(repository, log_path=repository.parent / f"server-{'held' if held else 'dropped'}.log") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        count = np.asarray([responses], dtype=np.int32)
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(count)
        client.async_stream_infer("pruned", [n], outputs=[grpcclient.InferRequestedOutput("ASKED")],
                                  enable_empty_final_response=True)
        received, failure = 0, None
        while True:
            try:
                result, error = got.get(timeout=timeout_s)
            except queue.Empty:
                failure = f"no response within {timeout_s:g} s"
                break
            if error is not None:
                failure = str(error)
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            received += 1
        client.stop_stream(cancel_requests=failure is not None)  # a dead stub never ends its request
        client.close()
    return received, failure


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--responses", type=int, default=20000)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="disagg-pruned-") as tmp:
        repository = Path(tmp) / "repository"
        (repository / "pruned" / "1").mkdir(parents=True)
        (repository / "pruned" / "config.pbtxt").write_text(CONFIG)
        (repository / "pruned" / "1" / "model.py").write_text(MODEL)
        for held in (False, True):
            started = time.monotonic()
            received, failure = serve(repository, held, args.responses, args.timeout)
            way = "held   " if held else "dropped"
            outcome = f"ended early: {failure[:160]}" if failure else "all served"
            print(f"{way}  {received:>6} of {args.responses} responses in {time.monotonic() - started:5.1f} s: {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
