"""Device faults: errors after which this process's device cannot be trusted, and how the worker leaves.

A CUDA kernel that fails on the device (an out-of-range index hits an `assert` in an embedding kernel, a
bad pointer, a crashed launch) leaves the CUDA context broken: every later CUDA call in this process fails
with the same error, whatever its inputs. Retrying, bisecting or serving on is futile, and a worker that
stays registered fails every batch routers send it. The only cure is a fresh process, so the worker
answers the batch at hand (its items blamed on the worker), leaves (NOT_SERVING, DRAINING on every stream,
its etcd lease revoked) and exits with `EXIT_DEVICE_FAULT` so its supervisor restarts it: Kubernetes
restarts the container, `sluice up` restarts the process (with a bounded rate).

Recoverable device errors are deliberately *not* faults: running out of device memory fails one forward
(bisection then runs smaller ones), and argument errors (`CUBLAS_STATUS_NOT_SUPPORTED`, `..._INVALID_VALUE`)
concern one shape. Calling those fatal would let any client restart workers at will.
"""

from __future__ import annotations

_STICKY_MESSAGES = (
    # cudaErrorAssert: a kernel's device-side assert, e.g. an embedding index >= the vocabulary.
    "device-side assert triggered",
    # cudaErrorIllegalAddress / MisalignedAddress / IllegalInstruction: the kernel touched what it must not.
    "an illegal memory access was encountered",
    "misaligned address",
    "an illegal instruction was encountered",
    # cudaErrorLaunchFailure / LaunchTimeout: the kernel crashed or was killed by the watchdog.
    "unspecified launch failure",
    "the launch timed out and was terminated",
    # cudaErrorECCUncorrectable: the hardware itself.
    "uncorrectable ECC error encountered",
    # cuBLAS / cuDNN report a broken context this way when the failed kernel was theirs (or ran after one).
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "CUBLAS_STATUS_MAPPING_ERROR",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR",
)
# Causes and contexts followed at most this deep (chains can be long, never usefully this long).
_CHAIN_LIMIT = 8


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says this process's device is unusable from now on.

    What counts: a RuntimeError (torch raises CUDA failures as RuntimeError or its subclass
    torch.AcceleratorError) whose message carries one of the sticky CUDA errors above: device-side assert,
    illegal memory access, misaligned address, illegal instruction, unspecified launch failure, launch
    timeout, uncorrectable ECC error, and cuBLAS/cuDNN execution or internal failures. What does not: any
    other type (a model's ValueError, the CPU's IndexError for a bad embedding index, a KeyError), out of
    memory, and RuntimeErrors with other messages, which a model raises for one bad item.
    """
    seen: BaseException | None = exc
    for _ in range(_CHAIN_LIMIT):
        if seen is None:
            return False
        if isinstance(seen, RuntimeError) and any(m in str(seen) for m in _STICKY_MESSAGES):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
