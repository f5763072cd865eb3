"""Running tritonserver: `TritonServer` (start, wait until ready, stop) and the `disagg-serve` launcher."""
from disagg.serve.server import ServerError, TritonServer, free_ports

__all__ = ["ServerError", "TritonServer", "free_ports"]
