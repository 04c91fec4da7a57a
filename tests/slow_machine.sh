#!/usr/bin/env bash
# Run a command as if on a slower machine, to check that load-shaped tests keep the regime they test
# (docs/benchmarks.md, "Checking the suite on a slower machine"):
#
#   tests/slow_machine.sh .venv/bin/pytest -q tests/e2e/test_overload.py
#
# The command and everything it starts share SLUICE_SLOW_CPU cores (default 0.8) under a CPU quota in a
# cgroup of their own: cgroup v2 `cpu.max` where the cpu controller is there, else cgroup v1
# `cpu.cfs_quota_us` (both need write access to the cgroup tree, e.g. root). Where neither is writable, or
# with SLUICE_SLOW_MODE=hog, a busy loop pinned to core 0 (taskset) runs for the command's whole run
# instead. SLUICE_SLOW_MODE=quota refuses to fall back. The cgroup is removed, or the busy loop killed, on
# any exit; the command's exit status is the script's.
set -euo pipefail

share="${SLUICE_SLOW_CPU:-0.8}"
mode="${SLUICE_SLOW_MODE:-auto}"
period=100000
cgroup=""
hog=""

say() { echo "slow_machine: $*" >&2; }

if [[ $# -eq 0 ]]; then
    say "usage: [SLUICE_SLOW_CPU=0.8] [SLUICE_SLOW_MODE=auto|quota|hog] $0 COMMAND [ARG...]"
    exit 2
fi
if ! quota=$(awk -v s="$share" 'BEGIN { if (s + 0 <= 0) exit 1; printf "%d", s * 100000 }'); then
    say "SLUICE_SLOW_CPU must be a positive number of cores, not '$share'"
    exit 2
fi

cleanup() {
    if [[ -n "$hog" ]]; then
        kill "$hog" 2>/dev/null || true
        wait "$hog" 2>/dev/null || true
    fi
    if [[ -n "$cgroup" && -d "$cgroup" ]]; then
        # Anything the command left running goes back to the parent, so the cgroup can be removed.
        local pid
        while read -r pid; do
            echo "$pid" >"$(dirname "$cgroup")/cgroup.procs" 2>/dev/null || true
        done <"$cgroup/cgroup.procs"
        rmdir "$cgroup" 2>/dev/null || say "could not remove $cgroup"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mount_of() {  # the mount point of a cgroup hierarchy: `mount_of cgroup2` or `mount_of cgroup cpu`
    awk -v type="$1" -v ctl="${2:-}" '$3 == type && (ctl == "" || $4 ~ "(^|,)" ctl "(,|$)") { print $2; exit }' \
        /proc/mounts
}

quota_v2() {
    local root
    root=$(mount_of cgroup2)
    [[ -n "$root" ]] && grep -qw cpu "$root/cgroup.controllers" 2>/dev/null || return 1
    grep -qw cpu "$root/cgroup.subtree_control" || echo +cpu >"$root/cgroup.subtree_control" 2>/dev/null || return 1
    mkdir "$root/sluice-slow-$$" 2>/dev/null || return 1
    cgroup="$root/sluice-slow-$$"
    echo "$quota $period" >"$cgroup/cpu.max" || return 1
    say "$share CPU (cgroup v2 cpu.max in $cgroup)"
}

quota_v1() {
    local root
    root=$(mount_of cgroup cpu)
    [[ -n "$root" ]] || return 1
    mkdir "$root/sluice-slow-$$" 2>/dev/null || return 1
    cgroup="$root/sluice-slow-$$"
    echo "$period" >"$cgroup/cpu.cfs_period_us" && echo "$quota" >"$cgroup/cpu.cfs_quota_us" || return 1
    say "$share CPU (cgroup v1 cpu.cfs_quota_us in $cgroup)"
}

start_hog() {
    if command -v taskset >/dev/null; then
        taskset -c 0 bash -c 'while :; do :; done' &
        hog=$!
        say "a busy loop (pid $hog) pinned to core 0 for the whole run"
    else
        bash -c 'while :; do :; done' &
        hog=$!
        say "a busy loop (pid $hog; no taskset, so not pinned) for the whole run"
    fi
}

case "$mode" in
    auto) quota_v2 || { cleanup; cgroup=""; quota_v1; } || { cleanup; cgroup=""; start_hog; } ;;
    quota) quota_v2 || { cleanup; cgroup=""; quota_v1; } || { say "no writable cgroup cpu controller"; exit 2; } ;;
    hog) start_hog ;;
    *) say "SLUICE_SLOW_MODE must be auto, quota or hog, not '$mode'"; exit 2 ;;
esac

set +e
if [[ -n "$cgroup" ]]; then
    bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cgroup" "$@"
else
    "$@"
fi
status=$?
exit "$status"
