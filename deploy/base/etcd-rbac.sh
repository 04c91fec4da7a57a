#!/bin/sh
# etcd users and roles for Sluice: each component reaches only its own prefixes (docs/kubernetes.md, "etcd").
# Run once per etcd cluster, as etcd's root, with etcdctl >= 3.5 pointed at it by the usual variables, e.g.
#   kubectl -n sluice port-forward svc/sluice-etcd 2379 &
#   kubectl -n sluice get secret sluice-etcd-root -o go-template='{{index .data "tls.crt" | base64decode}}' > root.crt
#   (the same for tls.key > root.key and ca.crt > ca.crt)
#   ETCDCTL_ENDPOINTS=https://127.0.0.1:2379 ETCDCTL_CACERT=ca.crt ETCDCTL_CERT=root.crt ETCDCTL_KEY=root.key \
#     sh deploy/base/etcd-rbac.sh
# Idempotent: what exists is kept, and authentication is turned on last. Users have no password: etcd takes
# the common name of a client certificate (components/cert-manager) as the user.
#
#   role / user       reads                          writes
#   sluice-router     workers/, routers/, tenants/   routers/ (its own record; etcd cannot tell one router's
#                                                    key from another's, so any router's)
#   sluice-worker     workers/                       workers/
#   sluice-operator   everything under the prefix    tenants/ (live overrides; they can only take away)
set -eu
PREFIX="${SLUICE_ETCD_PREFIX:-/sluice/}"
ETCDCTL="${ETCDCTL_BIN:-etcdctl}"

# Run etcdctl; an "already exists" or "already granted" answer counts as done.
ensure() {
    if out=$("$ETCDCTL" "$@" 2>&1); then
        return 0
    fi
    case "$out" in
        *"already exists"* | *"already"*) return 0 ;;
    esac
    echo "etcdctl $*: $out" >&2
    exit 1
}

grant() {  # ROLE PERMISSION FOLDER
    ensure role grant-permission "$1" "$2" "$PREFIX$3" --prefix=true
}

probe() {  # ROLE: read the one key named like the prefix (empty), which clients read to check etcd answers
    ensure role grant-permission "$1" read "$PREFIX"
}

ensure user add root --no-password
ensure role add root
ensure user grant-role root root

ensure role add sluice-router
probe sluice-router
grant sluice-router read workers/
grant sluice-router read tenants/
grant sluice-router readwrite routers/

ensure role add sluice-worker
probe sluice-worker
grant sluice-worker readwrite workers/

ensure role add sluice-operator
ensure role grant-permission sluice-operator read "$PREFIX" --prefix=true
grant sluice-operator readwrite tenants/

for component in router worker operator; do
    ensure user add "sluice-$component" --no-password
    ensure user grant-role "sluice-$component" "sluice-$component"
done

ensure auth enable
echo "etcd: roles sluice-router, sluice-worker, sluice-operator under $PREFIX; authentication on"
