#!/usr/bin/env bash
# From a fresh clone to a streamed answer: install, build configs/cpu-tiny.yaml, serve it, stream, stop.
# Ports: DISAGG_HTTP_PORT / DISAGG_GRPC_PORT / DISAGG_METRICS_PORT (default 8000 / 8001 / 8002).
set -euo pipefail
cd "$(dirname "$0")/.."
http=${DISAGG_HTTP_PORT:-8000} grpc=${DISAGG_GRPC_PORT:-8001} metrics=${DISAGG_METRICS_PORT:-8002}

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e .

.venv/bin/build-engines --config configs/cpu-tiny.yaml

log=$(mktemp -t disagg-serve.XXXXXX.log)
.venv/bin/disagg-serve --model-repository model_repository --http-port "$http" --grpc-port "$grpc" \
    --metrics-port "$metrics" --exit-timeout-secs 5 >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
    grep -q "disagg-serve: ready" "$log" && break
    kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
done
grep -q "disagg-serve: ready" "$log" || { tail -40 "$log"; echo "server not ready after 120 s"; exit 1; }
echo "server ready (log: $log)"

echo "--- disaggregated (ensemble), streamed over gRPC:"
.venv/bin/python tools/stream_client.py --url "127.0.0.1:$grpc" --model ensemble \
    --prompt "It was the best of times, it was the worst of times," --max-tokens 48
echo "--- the same prompt through the aggregated baseline, HTTP generate:"
curl -s -X POST "http://127.0.0.1:$http/v2/models/aggregated/generate" \
    -d '{"text_input": "It was the best of times, it was the worst of times,", "max_tokens": 48}'
echo
