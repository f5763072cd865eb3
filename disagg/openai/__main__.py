"""`python -m disagg.openai`: the OpenAI-compatible API for a running tritonserver (disagg-serve starts it).

    python -m disagg.openai --model-repository model_repository --triton-grpc-url 127.0.0.1:8001 --port 9000
"""
from __future__ import annotations

import argparse

import uvicorn

from disagg.openai.app import create_app
from disagg.openai.deployment import Deployment


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m disagg.openai", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", required=True, help="the repository the server serves (for tokenizer, limits, chat template)")
    p.add_argument("--triton-grpc-url", default="127.0.0.1:8001", help="the server's gRPC endpoint (default 127.0.0.1:8001)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=9000, help="port to listen on (default 9000)")
    p.add_argument("--metrics-url", action="append", default=[], metavar="NAME=URL",
                   help="a server's Prometheus endpoint, merged on /metrics with the label server=NAME (repeatable)")
    args = p.parse_args(argv)
    metrics = dict(item.split("=", 1) for item in args.metrics_url)
    deployment = Deployment.load(args.model_repository)
    print(f"disagg-openai: {', '.join(deployment.models)} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(deployment, args.triton_grpc_url, metrics), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
