"""Requests through the official Triton client, in a process of their own: tritonclient's generated
protos declare the same `inference.*` messages as Sluice's, and one process cannot hold both.

    python -m sluice_inference.bench.gpu.triton_requests --target HOST:PORT --model M --rows in.npz \
        --out out.npz [--concurrent]

`in.npz` holds arrays r0, r1, ... ([rows, L] INT64 token ids), one request each; `out.npz` gets, per
request, r<i> (the `pooled` output) or e<i> (the error's text), so every request has one outcome.
Imports nothing of Sluice's.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def infer(client: Any, model: str, tokens: np.ndarray) -> np.ndarray | str:
    """One request's `pooled` output, or its error's text."""
    given = triton.InferInput("tokens", list(tokens.shape), "INT64")
    given.set_data_from_numpy(tokens)
    try:
        result = client.infer(
            model, [given], outputs=[triton.InferRequestedOutput("pooled")], client_timeout=60
        )
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    return np.asarray(result.as_numpy("pooled"))


def main() -> int:
    """Send every request of the input file, one at a time or all at once; write their outcomes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrent", action="store_true")
    args = parser.parse_args()
    with np.load(args.rows) as data:
        requests = [data[f"r{i}"] for i in range(len(data.files))]
    client = triton.InferenceServerClient(args.target)
    if args.concurrent:
        with ThreadPoolExecutor(len(requests)) as pool:
            outcomes = list(pool.map(lambda tokens: infer(client, args.model, tokens), requests))
    else:
        outcomes = [infer(client, args.model, tokens) for tokens in requests]
    saved = {}
    for i, outcome in enumerate(outcomes):
        saved[f"r{i}" if isinstance(outcome, np.ndarray) else f"e{i}"] = np.asarray(outcome)
    np.savez(args.out, **saved)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
