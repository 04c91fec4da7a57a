"""Backend for TorchScript artifacts (`model.pt`), the format of Triton's `pytorch_libtorch` platform.

TorchScript is deprecated as of PyTorch 2.13 (`torch.jit.load` warns): prefer `torch_export` for new
models; this backend serves the ones that only exist as scripted or traced modules.

The module runs frozen for inference unless its config says `freeze: false`: `torch.jit.freeze` makes its
weights constants and `torch.jit.optimize_for_inference` rewrites the graph for them (a linear layer's
weight is transposed once at load rather than inside every forward). On the peers' MLP that cut the
forward's CPU by ~9 % in a worker sharing its core (docs/performance.md). A module torch cannot freeze is
served as loaded.

Binding, as Triton's PyTorch backend does it:
- inputs: when every declared input is named `<anything>__<i>` (Triton's `INPUT__0`, `INPUT__1`), input i
  is forward's i-th argument, whatever forward calls it; otherwise each input is passed by keyword, so its
  name must be one of forward's parameters. The backend-only mask input (config `batching.mask_input`)
  follows the declared ones: last positionally, or by its name.
- outputs: when every output is named `<anything>__<i>`, output i is element i of what forward returns;
  otherwise outputs are taken in config order (backends/base.py, `name_outputs`).
A config that does not fit the module's signature is refused at load, naming the real signature.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from sluice_inference.worker.backends.base import name_outputs

_POSITIONAL = re.compile(r"^.+__(\d+)$")
log = logging.getLogger(__name__)


class SignatureMismatch(ValueError):
    """The config's tensor names cannot be bound to the module's forward (names the real signature)."""


def positions(names: Sequence[str]) -> list[int] | None:
    """Each name's index when every name follows Triton's `<name>__<i>` convention; None when none does.

    Raises SignatureMismatch when only some do, or the indices are not exactly 0..n-1.
    """
    found = [_POSITIONAL.match(name) for name in names]
    if not any(found):
        return None
    if not all(found):
        plain = [n for n, m in zip(names, found, strict=True) if m is None]
        raise SignatureMismatch(f"{list(names)} mix positional names (INPUT__0) with plain names {plain}")
    indices = [int(m.group(1)) for m in found if m is not None]
    if sorted(indices) != list(range(len(names))):
        raise SignatureMismatch(f"{list(names)}: positional indices must be exactly 0..{len(names) - 1}")
    return indices


class TorchScriptBackend:
    """A scripted or traced module on one device."""

    name = "torchscript"

    def __init__(
        self,
        artifact: Path,
        device: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        mask: str | None = None,
        *,
        freeze: bool = True,
    ) -> None:
        """`inputs` and `outputs`: the declared tensor names in config order; `mask`: the backend-only
        mask input, if the model takes one; `freeze`: run the module frozen for inference (module
        docstring). SignatureMismatch when they cannot bind to forward."""
        # torch.jit.load carries no type annotations (it is deprecated, so they will not come).
        loaded: torch.jit.ScriptModule = torch.jit.load(  # type: ignore[no-untyped-call]
            str(artifact), map_location=device
        )
        loaded.eval()
        schema = loaded.forward.schema  # type: ignore[attr-defined]  # a scripted method; torch types it Callable
        parameters = schema.arguments[1:]  # without `self`
        shown = ", ".join(f"{p.name}: {p.type}" for p in parameters)
        self.signature = f"forward({shown}) -> {schema.returns[0].type}"
        try:
            order = positions(inputs)
        except SignatureMismatch as exc:
            raise SignatureMismatch(f"inputs {exc}; the model's {self.signature}") from None
        if order is None:
            self._positional: list[str] | None = None
            _check_keywords([*inputs, *([mask] if mask else [])], parameters, self.signature)
        else:
            by_index = sorted(zip(order, inputs, strict=True))
            self._positional = [name for _, name in by_index] + ([mask] if mask else [])
            _check_arity(len(self._positional), parameters, self.signature)
        self._outputs = tuple(outputs)
        self._output_positions = positions(outputs)
        self._module = for_inference(loaded, artifact) if freeze else loaded
        self.frozen = self._module is not loaded
        """Whether the module runs frozen (asked for, and torch could freeze it)."""

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the scripted module over one batch."""
        if self._positional is None:
            result = self._module(**inputs)
        else:
            result = self._module(*(inputs[name] for name in self._positional))
        if self._output_positions is None:
            return name_outputs(result, self._outputs)
        returned = [result] if isinstance(result, torch.Tensor) else list(result)
        if len(returned) <= max(self._output_positions):
            raise TypeError(
                f"model returned {len(returned)} tensor(s), config declares {list(self._outputs)}"
            )
        return {name: returned[i] for name, i in zip(self._outputs, self._output_positions, strict=True)}


def for_inference(module: torch.jit.ScriptModule, artifact: Path) -> torch.jit.ScriptModule:
    """`module` (loaded, in eval mode) frozen and optimized for inference, or `module` itself when torch
    cannot freeze it: what the backend runs unless the config says `freeze: false` (the GPU kit's
    in-process reference runs the same)."""
    try:
        return torch.jit.optimize_for_inference(torch.jit.freeze(module))
    except Exception as exc:  # torch's passes raise many types for modules they cannot handle: serve as is
        log.warning(
            "serving %s as loaded: torch could not freeze it (%s: %s)", artifact, type(exc).__name__, exc
        )
        return module


def _check_keywords(names: Sequence[str], parameters: Sequence[torch.Argument], signature: str) -> None:
    """Every name is a parameter, and every parameter without a default is named."""
    known = {p.name for p in parameters}
    unknown = [n for n in names if n not in known]
    missing = [p.name for p in parameters if p.name not in names and not p.has_default_value()]
    if unknown or missing:
        raise SignatureMismatch(
            f"inputs {list(names)} do not fit the model's {signature}: no parameter {unknown}, "
            f"nothing for {missing} (rename the inputs to forward's parameters, or name them INPUT__0, "
            "INPUT__1, ... to bind by position)"
        )


def _check_arity(count: int, parameters: Sequence[torch.Argument], signature: str) -> None:
    """`count` positional arguments fill forward's required parameters and no more than it has."""
    required = sum(1 for p in parameters if not p.has_default_value())
    if not required <= count <= len(parameters):
        raise SignatureMismatch(f"{count} positional input(s) do not fit the model's {signature}")
