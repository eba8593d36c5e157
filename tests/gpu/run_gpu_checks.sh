#!/usr/bin/env bash
# megatron-core on S3 on a GPU machine, no CUDA stand-in: tests/gpu/gpu_checks.py (see its docstring), log to $OUT.
# Wheels (no network there) are carried in .whl/ at the repository root and installed into /tmp/site:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Usage (repository root): OUT=/some/dir bash tests/gpu/run_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu-checks.log"
{
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -5
    "$PYTHON" --version
    if ls .whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.installed ]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
    fi
    export PYTHONPATH="/tmp/site:$PWD:$PWD/tests/helpers${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c 'import importlib.metadata as m, torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), *(f"{d} {m.version(d)}" for d in ("megatron-core", "boto3", "moto", "numpy")))'
    # Dummy credentials for the local moto server only (the scripts set the endpoint themselves)
    export AWS_ACCESS_KEY_ID=gpu-checks AWS_SECRET_ACCESS_KEY=gpu-checks AWS_DEFAULT_REGION=us-east-1
    export OUT
    timeout "${GPU_CHECKS_TIMEOUT:-540}" "$PYTHON" tests/gpu/gpu_checks.py
    echo "exit: $?"
} 2>&1 | tee "$LOG"
