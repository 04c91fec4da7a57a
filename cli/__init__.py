"""The `sluice` command: composes router, worker, local cluster and client commands.

It lives outside `common/` because it imports both sides (docs/design.md §2 forbids that in `common/`); see
docs/architecture.md.

Importing this package sets the gRPC runtime's I/O mode for the process (common/grpc_runtime.py): every
`sluice` command, and so every router and worker process, imports it before anything imports grpc.
"""

from sluice_inference.common.grpc_runtime import prefer_polling_thread_io

prefer_polling_thread_io()
