#!/usr/bin/env bash
# How soon a refused request learns it was refused: Sluice started as the shared peer harness starts it
# (../shared/peers: router + worker + etcd pinned to core 0), `sluice bench` on core 1 at each RATE with
# bench/scenarios/peer_overload.yaml (2 s deadline, as the harness's client timeout); the report prints
# p50 and p99 of the time from send to each kind of refusal.
#   bench/peer_refusals.sh RATE [RATE...]        e.g. bench/peer_refusals.sh 1000 2000
# env: PEERS (default ../shared/peers), SLUICE_PROJECT (the checkout to measure, default this one),
#      SLUICE_ROUTER__DOOR_MAX_DELAY_MS (the door's bound; the peer sitting uses 20)
set -euo pipefail
(($# > 0)) || { echo "usage: bench/peer_refusals.sh RATE [RATE...]" >&2; exit 2; }
project=$(cd "$(dirname "$0")/.." && pwd)
peers=$(cd "${PEERS:-$project/../shared/peers}" && pwd)
source "$peers/lib.sh"
for rate in "$@"; do
  cmd=$(peer_start_cmd sluice)
  setsid taskset -c "$SERVER_CPUS" env SLUICE_PROJECT="${SLUICE_PROJECT:-$project}" $cmd \
    >"$PEERS_ROOT/logs/sluice.refusals.log" 2>&1 &
  lead=$!
  trap 'stop_session "$lead"' EXIT
  target=$(peer_targets sluice)
  target=${target#* }
  # shellcheck disable=SC2086
  loadgen $target --ready-only --ready-timeout 300 >/dev/null
  echo "== $rate req/s offered"
  taskset -c "$LOADGEN_CPUS" "$project/.venv/bin/sluice" bench "$project/bench/scenarios/peer_overload.yaml" \
    --rate "$rate"
  stop_session "$lead"
  trap - EXIT
done
