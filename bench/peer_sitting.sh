#!/usr/bin/env bash
# One sitting of the peer comparison (docs/performance.md): Sluice, PyTriton, MLServer, the bare grpc.aio
# echo and minpath (the harness's bare router + worker: the floor of Sluice's shape) through the shared harness (../shared/peers: each server pinned to core 0, the load generator to core 1),
# every rate a fresh start (the harness's sweep stops at the first saturated rate; the overload curves need
# the points past it), with the harness's 2 s client timeout and with the 50 ms SLO sent as the deadline.
#   bench/peer_sitting.sh OUT_DIR          then: python -m sluice_inference.bench.peer_report OUT_DIR --plot docs/figures/peers.png
# env: SLUICE_RATES, TRITON_RATES, MLSERVER_RATES, ECHO_RATES, MINPATH_RATES (a rate list; empty skips
#      that system), TIMEOUTS ("2 0.05"), DURATION (15), PEERS (../shared/peers),
#      TAGS (the harness's endpoints, default grpc), SLUICE_PROJECT (the checkout to measure, default this one), SLUICE_LABEL (default sluice),
#      DOOR_MS (the router's door_max_delay_ms for the run, default 30: 0.6 of the 50 ms SLO; empty: unset),
#      OTHER_MAX (default 0.05; empty: never) and RETRIES (default 2): a point during which other work on the
#      machine took more than OTHER_MAX of a core (the harness's other_cpu_frac) is run again, up to RETRIES
#      more times; peer_report keeps the least disturbed try of each rate and marks one still disturbed,
#      FLOOR_RATE (default 800; empty skips): a bare grpc.aio server's CPU per answered and per refused call
#      at that rate (bench/grpc_floor.py), into OUT/floor.txt: the floor under refusing (issue 17),
#      MINIMAL_RATES (default empty: skipped) and MINIMAL_HOLDS (default "5 15"): our minimal path
#      (bench/minimal_path.py: bare router + worker, the MLP run frozen as Sluice's worker runs it) holding
#      each batch H ms as Triton's batcher does, labelled minimal-holdH: the floor of Sluice's shape with
#      batches that fill, run through a copy of the harness (OUT/harness-holdH) whose minpath is that path
set -euo pipefail
out=${1:?usage: bench/peer_sitting.sh OUT_DIR}
project=$(cd "$(dirname "$0")/.." && pwd)
peers=$(cd "${PEERS:-$project/../shared/peers}" && pwd)
mkdir -p "$out"
export DURATION=${DURATION:-15} SLUICE_PROJECT=${SLUICE_PROJECT:-$project} TAGS=${TAGS:-grpc}  # Sluice speaks gRPC only
door_ms=${DOOR_MS-30}  # empty: leave the router's default (a checkout without the door)
[[ -n $door_ms ]] && export SLUICE_ROUTER__DOOR_MAX_DELAY_MS=$door_ms
label=${SLUICE_LABEL:-sluice}

other_max=${OTHER_MAX-0.05} retries=${RETRIES:-2}

other_work() {  # other_work JSONL -> the other_cpu_frac of its last line (0 when it has none)
  tail -n 1 "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin).get("other_cpu_frac", 0))'
}

point() {  # point NAME RATE TIMEOUT LABEL, run again while other work disturbs it
  local dir="$out/t$3" try other
  mkdir -p "$dir"
  for ((try = 0; try <= retries; try++)); do
    if ! RESULTS_DIR="$dir/$4" TIMEOUT=$3 "${PEERS_HARNESS:-$peers}/sweep.sh" "$1" "$2"; then
      echo "[sitting] $4 at $2 failed" >&2
      return 0
    fi
    [[ -n $other_max ]] || return 0
    other=$(other_work "$dir/$4/$1.jsonl")
    python3 -c 'import sys; sys.exit(float(sys.argv[1]) > float(sys.argv[2]))' "$other" "$other_max" && return 0
    echo "[sitting] $4 at $2: other work took $other of a core (over $other_max)" >&2
  done
}

minimal_harness() {  # minimal_harness HOLD_MS -> a copy of the harness whose `minpath` is our minimal path
  local copy="$out/harness-hold$1"
  rm -rf "$copy" && cp -r "$peers" "$copy"
  cat >"$copy/servers/minpath/start.sh" <<SH
#!/usr/bin/env bash
# Written by bench/peer_sitting.sh: bench/minimal_path.py serving the peers' MLP, the router holding $1 ms.
set -euo pipefail
export PYTHONPATH="$project"
run=("$project/.venv/bin/python" -m sluice_inference.bench.minimal_path)
"\${run[@]}" --serve worker --port 8302 --model-file "\$PEERS_ROOT/models/mlp/1/model.pt" --in-width 256 &
exec "\${run[@]}" --serve router --port 8301 --worker 127.0.0.1:8302 --in-width 256 --out-width 10 \\
  --output-name output --hold-ms $1
SH
  echo "$copy"
}

for timeout in ${TIMEOUTS:-2 0.05}; do
  for rate in ${SLUICE_RATES-300 500 700 1000 1500 2000}; do point sluice "$rate" "$timeout" "$label"; done
  for rate in ${TRITON_RATES-300 1000 2000 3000 4000}; do point triton "$rate" "$timeout" triton; done
  for rate in ${MLSERVER_RATES-300 500 800 1200}; do point mlserver "$rate" "$timeout" mlserver; done
  for rate in ${ECHO_RATES-2000 4000}; do point echo "$rate" "$timeout" echo; done
  for rate in ${MINPATH_RATES-500 1000 1500 2000}; do point minpath "$rate" "$timeout" minpath; done
  for hold in ${MINIMAL_HOLDS-5 15}; do
    [[ -n ${MINIMAL_RATES-} ]] || break
    harness=$(minimal_harness "$hold")
    for rate in $MINIMAL_RATES; do
      PEERS_HARNESS=$harness point minpath "$rate" "$timeout" "minimal-hold$hold"
    done
  done
done
if [[ -n ${FLOOR_RATE-800} ]]; then
  for mode in aio-ok aio-refuse; do
    "$project/.venv/bin/python" -m sluice_inference.bench.grpc_floor --mode "$mode" --rate "${FLOOR_RATE-800}" \
      --seconds 8 2>&1 | tail -1 | tee -a "$out/floor.txt"
  done
fi
echo "[sitting] results under $out"
