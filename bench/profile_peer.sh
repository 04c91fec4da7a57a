#!/usr/bin/env bash
# CPU per request by stage: Sluice as the shared peer harness runs it (../shared/peers: router + worker +
# etcd pinned to core 0, the peers' load generator on core 1), sampled with py-spy while the load runs.
#   bench/profile_peer.sh RATE [SECONDS]        e.g. bench/profile_peer.sh 400 10
# env: PEERS (default ../shared/peers), OUT (default $PEERS_ROOT/profile), SLUICE_ARGS (extra `up` flags),
#      SLUICE_PROJECT (the checkout to measure, default this one: an older commit's worktree for a before),
#      NATIVE=1 (also sample native frames: grpc's C core; pauses the processes while sampling)
# Needs `../shared/peers/setup.sh tools` once and py-spy (a dev dependency: `make install`).
# Prints the breakdown (bench/cpu_breakdown.py) and each thread's CPU and run-queue wait from the kernel
# (bench/thread_cpu.py); the raw samples stay in $OUT for flame graphs.
set -euo pipefail
rate=${1:?usage: bench/profile_peer.sh RATE [SECONDS]}
seconds=${2:-10}
project=$(cd "$(dirname "$0")/.." && pwd)
peers=$(cd "${PEERS:-$project/../shared/peers}" && pwd)
source "$peers/lib.sh"
out=${OUT:-$PEERS_ROOT/profile}
mkdir -p "$out"
pyspy=$project/.venv/bin/py-spy
[[ -x $pyspy ]] || { echo "py-spy not found: run make install" >&2; exit 1; }

cmd=$(peer_start_cmd sluice)
setsid taskset -c "$SERVER_CPUS" env SLUICE_PROJECT="${SLUICE_PROJECT:-$project}" $cmd >"$out/server.log" 2>&1 &
lead=$!
trap 'stop_session "$lead"' EXIT
target=$(peer_targets sluice)
target=${target#* }
# shellcheck disable=SC2086
loadgen $target --ready-only --ready-timeout 300 >/dev/null
# the peer's own router and worker (other clusters may run on this machine)
pid_of() {
  for pid in $(sesspids "$lead"); do
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE -- "-m (sluice_inference\.)?cli .*$1"; then echo "$pid"; return; fi
  done
}
router=$(pid_of "router --listen")
worker=$(pid_of "worker --repository")
[[ -n $router && -n $worker ]] || { echo "router or worker not found" >&2; exit 1; }
cpu_of() { awk '{print ($14 + $15)}' "/proc/$1/stat"; }
tck=$(getconf CLK_TCK)

sampling="--nonblocking"
[[ -n ${NATIVE:-} ]] && sampling="--native"
warmup=3
total=$((seconds + 2 * warmup))
# shellcheck disable=SC2086
loadgen $target --rate "$rate" --duration "$total" --warmup 0 --timeout 2 --label profile >"$out/load.json" &
load=$!
sleep "$warmup"
r0=$(cpu_of "$router"); w0=$(cpu_of "$worker")
"$project/.venv/bin/python" -m sluice_inference.bench.thread_cpu snap "$router" "$worker" >"$out/threads0.json"
"$pyspy" record $sampling --rate 250 --format raw -d "$seconds" -p "$router" -o "$out/router.raw" \
  >/dev/null 2>&1 &
spy_router=$!
"$pyspy" record $sampling --rate 250 --format raw -d "$seconds" -p "$worker" -o "$out/worker.raw" \
  >/dev/null 2>&1 &
spy_worker=$!
wait "$spy_router" "$spy_worker"
r1=$(cpu_of "$router"); w1=$(cpu_of "$worker")
"$project/.venv/bin/python" -m sluice_inference.bench.thread_cpu snap "$router" "$worker" >"$out/threads1.json"
wait "$load"
router_s=$(python3 -c "print(($r1 - $r0) / $tck)")
worker_s=$(python3 -c "print(($w1 - $w0) / $tck)")
requests=$(python3 -c "print(round($rate * $seconds))")
echo "rate $rate req/s for ${seconds}s: router ${router_s} CPU-s, worker ${worker_s} CPU-s; load: $(cat "$out/load.json")"
"$project/.venv/bin/python" -m sluice_inference.bench.cpu_breakdown "$out/router.raw" "$out/worker.raw" \
  --cpu-s "$router_s" "$worker_s" --requests "$requests"
echo
echo "By thread, from the kernel's scheduler statistics (py-spy counts a runnable thread waiting for the core as busy):"
"$project/.venv/bin/python" -m sluice_inference.bench.thread_cpu table "$out/threads0.json" "$out/threads1.json" \
  --requests "$requests" --names router worker
