"""Process exit statuses that one process sets and another acts on.

The worker sets `EXIT_DEVICE_FAULT` (worker/faults.py says when); its supervisor — Kubernetes, or the local
cluster launcher (common/child_processes.py) — starts it again on that status and on no other.
"""

from __future__ import annotations

EXIT_DEVICE_FAULT = 75
"""The worker's exit status after a device fault (EX_TEMPFAIL in sysexits.h: "try again later"): the
process is broken, not its configuration, so a supervisor should start it again. Any other non-zero exit
(bad config, a model that fails to load or warm up) would fail again the same way."""
