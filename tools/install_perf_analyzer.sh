#!/usr/bin/env bash
# perf_analyzer (Triton's load generator, which genai-perf drives) into a venv's bin/, with what it loads.
# The binary ships only in the tritonclient manylinux wheels (the perf-analyzer package on the index is an
# empty placeholder); 2.51.0 matches the bundled server. Installing that wheel would pin this venv's
# tritonclient and geventhttpclient below what locust needs, so only its bin/perf_analyzer is taken. It
# links Debian's libb64 and the CUDA runtime library (nvidia-cuda-runtime-cu12) even on a CPU machine.
# x86_64 Linux. Usage: bash tools/install_perf_analyzer.sh [venv, default .venv]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
if [ ! -x "$venv/bin/perf_analyzer" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$venv/bin/python" -m pip download --quiet --no-deps --only-binary :all: tritonclient==2.51.0 -d "$tmp"
    "$venv/bin/python" - "$tmp"/tritonclient-2.51.0-*.whl "$venv/bin/perf_analyzer" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    data = wheel.read("tritonclient-2.51.0.data/data/bin/perf_analyzer")
with open(sys.argv[2], "wb") as out:
    out.write(data)
PY
    chmod +x "$venv/bin/perf_analyzer"
fi
"$venv/bin/python" -m pip install --quiet nvidia-cuda-runtime-cu12
if ! ldconfig -p | grep -q "libb64.so.0d"; then
    apt-get update -qq && apt-get install -y -qq libb64-0d
fi
echo "perf_analyzer: $venv/bin/perf_analyzer (LD_LIBRARY_PATH needs $("$venv/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))'))"
