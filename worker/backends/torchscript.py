"""Backend for TorchScript artifacts (`model.pt`), the second format.

TorchScript is deprecated as of PyTorch 2.13 (`torch.jit.load` warns): prefer `torch_export`. Kept for
models that only exist as scripted modules. The module is called with keyword arguments named after the
config inputs (plus the mask input), so its forward's parameter names must match them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from worker.backends.base import name_outputs


class TorchScriptBackend:
    """A scripted or traced module on one device."""

    name = "torchscript"

    def __init__(self, artifact: Path, device: str, output_names: Sequence[str]) -> None:
        # torch.jit.load carries no type annotations (it is deprecated, so they will not come).
        self._module: torch.jit.ScriptModule = torch.jit.load(  # type: ignore[no-untyped-call]
            str(artifact), map_location=device
        )
        self._module.eval()
        self._output_names = tuple(output_names)

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the scripted module over one batch."""
        return name_outputs(self._module(**inputs), self._output_names)
