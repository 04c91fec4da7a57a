#!/usr/bin/env bash
# The GPU kit's one run (docs/gpu.md): etcd, router processes and one worker on the device, then the
# stages of bench/gpu/kit.py; gpu_kit.json, gpu_kit.png and the processes' logs land in $OUT.
#   on a GPU machine:  bench/gpu/run.sh                      (after bench/gpu/prepare.sh here)
#   CPU rehearsal:     OUT=/tmp/kit bench/gpu/run.sh --device cpu --quick
# Other arguments go to the kit (--device, --quick, --routers). With Sluice's dependencies already
# importable (a developer venv: PYTHON=.venv/bin/python) nothing is installed; otherwise the wheels of
# bench/gpu/wheelhouse/ not already present at the same version are installed into a temporary folder put
# first on PYTHONPATH, and etcd is unpacked beside them. The kit is stopped with SIGTERM after
# KIT_TIMEOUT_S (default 420 s), and the JSON it wrote after each stage stays.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
house="$here/wheelhouse"
python=${PYTHON:-python3}
out=${OUT:-$root/bench/results/gpu}
mkdir -p "$out"
work=$(mktemp -d -t sluice-gpu-run-XXXXXX)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
imports="import pydantic, pydantic_core, aetcd, yaml, prometheus_client, opentelemetry.sdk, grpc_health, grpc_reflection, grpc_status, google.rpc, redis, cryptography, numpy, torch"

if "$python" -c "$imports" 2>/dev/null; then
    echo "==> Sluice's dependencies are importable by $python: nothing to install"
elif [ -d "$house" ]; then
    started=$SECONDS
    mapfile -t missing < <("$python" - "$house" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        if metadata.version(name) == version:
            continue
    except metadata.PackageNotFoundError:
        pass
    print(wheel)
PY
)
    echo "==> installing ${#missing[@]} wheel(s) from $house into $work/site"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
        "${missing[@]}" || exit 1
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "    done in $((SECONDS - started)) s"
else
    echo "error: $python cannot import Sluice's dependencies and there is no $house (run bench/gpu/prepare.sh)" >&2
    exit 1
fi
if ! command -v etcd >/dev/null && [ ! -x "$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/etcd" ]; then
    if [ ! -f "$house/etcd.gz" ]; then
        echo "error: no etcd on PATH and no $house/etcd.gz (run bench/gpu/prepare.sh)" >&2
        exit 1
    fi
    mkdir -p "$work/bin"
    gunzip -c "$house/etcd.gz" >"$work/bin/etcd" && chmod +x "$work/bin/etcd"
    export PATH="$work/bin:$PATH"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root" || exit 1
timeout --signal=TERM --kill-after=30 "${KIT_TIMEOUT_S:-420}" \
    "$python" -m sluice_inference.bench.gpu.kit --out "$out" "$@"
