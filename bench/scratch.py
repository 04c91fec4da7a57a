"""A bench's scratch folder: removed when the bench ends well, kept (and named) when it fails.

A bench that starts a cluster writes its models, configuration, logs and etcd's data there; etcd alone
preallocates ~60 MB a cluster, and the two-tenant bench left 123 MB in the temporary folder per run. The
logs matter only when something went wrong, and then the folder's path is printed so they can be read.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A fresh folder under the temporary folder, named `prefix` and a random suffix."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except BaseException:
        print(f"kept the run's folder, with its logs: {folder}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
