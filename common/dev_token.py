"""The one cluster token this repository publishes, and who may accept it.

deploy/overlays/dev/cluster-token.env commits a fixed router ↔ worker token so a laptop cluster comes up
with one `kubectl apply`. Everyone who has read the repository holds it, so it authenticates nothing: a
worker accepts it only in development mode (`sluice worker --dev`, `worker.dev`), and refuses to start
with it otherwise, as it refuses the base's placeholder (common/cluster_auth.py).
"""

from __future__ import annotations

from sluice_inference.common.config import ConfigError
from sluice_inference.common.trust_settings import ClusterSettings

DEV_CLUSTER_TOKEN = "sluice-dev-cluster-token-not-secret"
"""The value of SLUICE_CLUSTER__TOKEN in deploy/overlays/dev/cluster-token.env (a test keeps them equal)."""


def refuse_dev_token(settings: ClusterSettings, *, dev: bool) -> None:
    """ConfigError when a worker outside development mode would accept the published development token."""
    if not dev and DEV_CLUSTER_TOKEN in settings.accepted():
        raise ConfigError(
            "cluster.token: the development token published in deploy/overlays/dev; a worker accepts it "
            "only with --dev (a laptop cluster). Set a random one (openssl rand -hex 32)"
        )
