"""Backend for `torch.export` artifacts (`model.pt2`), the primary format.

The program is loaded once and moved to the device with `move_to_device_pass` (a plain `.to()` would
leave device constants baked into the graph behind). The exported module is called the way it was
exported: with keyword arguments when it was exported with kwargs (the demo models); else positionally,
matching its forward's parameter names to config input names when they all agree, and otherwise in
config order (declared inputs, then the mask input) — the order the executor builds the batch in.

Input checks: a module exported by a recent torch guards its own inputs inside the graph (`_guards_fn`:
dtypes, ranks, the dynamic dims' ranges); its forward pre-hook then only checks that the call has the
exported structure (argument names and count), ~50 µs per forward on the demo MLP. Every call here has
the structure of the first (the executor always passes the config's inputs, in config order), so once
one forward has passed that check it is turned off (`validate_inputs`); the guards still run on every
call. A module without guards keeps the pre-hook's full checks.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass

from sluice_inference.worker.backends.base import name_outputs


class TorchExportBackend:
    """An exported program on one device."""

    name = "torch_export"

    def __init__(self, artifact: Path, device: str, output_names: Sequence[str]) -> None:
        program = torch.export.load(artifact)
        if torch.device(device).type != "cpu":
            program = move_to_device_pass(program, device)
        self._module = program.module()
        args_spec = program.call_spec.in_spec
        # in_spec is the pytree of (args, kwargs); an export with no positional args is called by keyword.
        self._by_keyword = args_spec is not None and args_spec.child(0).num_children == 0
        self._parameters = list(inspect.signature(self._module.forward).parameters)
        self._output_names = tuple(output_names)
        self._structure_checks_only = hasattr(self._module, "_guards_fn")

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the exported module over one batch."""
        if self._by_keyword:
            result = self._module(**inputs)
        elif set(self._parameters) == set(inputs):
            result = self._module(*(inputs[p] for p in self._parameters))
        else:
            result = self._module(*inputs.values())
        if self._structure_checks_only:  # this call's structure passed: every later call has it too
            # A plain bool attribute of the module; the stubs type every Module attribute Tensor | Module.
            self._module.validate_inputs = False  # type: ignore[assignment]
            self._structure_checks_only = False
        return name_outputs(result, self._output_names)
