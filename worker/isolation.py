"""Exact isolation of the items that make a forward fail: recursive halving (adaptive group testing).

A forward runs its items together, so one bad item fails all of them. `isolate` re-runs the failed group
in halves: a half that passes is accepted, a half that fails is halved again, down to single items. An
item ends failed only if it failed forwarded *alone*; every other item gets the outputs of a forward that
passed. So k bad items in a batch of n fail exactly those k, for any k, and an item that is only bad in
company (a batch too large for the device's memory, two items that clash) fails nobody.

Cost (n ≥ 2 items whose joint forward failed; ⌈·⌉ = ceiling):
- at most **2·n - 2** extra forwards, always, whatever makes forwards fail: the calls form a binary tree
  with the failed forward at its root, where each failing node of ≥ 2 items has exactly two children,
  each forwarded once; a binary tree with n leaves has n - 1 internal nodes.
- at most **2·k·⌈log2 n⌉** extra forwards when a forward fails exactly when it holds one of k bad items:
  halving makes the tree ⌈log2 n⌉ deep, so nodes of ≥ 2 items sit at depths 0 … ⌈log2 n⌉ - 1; the nodes
  at one depth are disjoint, so at most min(k, 2^d) of those at depth d hold a bad item and fail; each
  failing one costs two forwards: 2·Σ min(k, 2^d) ≤ 2·k·⌈log2 n⌉. (n = 32: k = 1 → 10, k = 2 → ≤ 18,
  k = 4 → ≤ 30, k = 8 → ≤ 46; never more than 62.)
- at most **R·⌈log2 n⌉** rows in those extra forwards (R: the failed forward's rows; n·⌈log2 n⌉ for
  one-row items): each depth forwards disjoint parts of the group, so each row at most once per depth.
  This is the price of exactness a hostile client can make one batch pay: a batch of 32 one-row items
  that all fail costs 62 extra forwards of 160 rows in all (on top of the batch's own 32), and one
  canary forward (executor.py). Tenant quotas bound how many such batches it can send.

No clock, no device, no torch: the caller supplies `run` (forward these items now) and `suspect`
(whether a forward's outcomes are a failure worth splitting: a failure the items may have caused, not a
device fault that every further forward would repeat).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")


def isolate(
    items: Sequence[Item],
    outcomes: list[Outcome],
    run: Callable[[Sequence[Item]], list[Outcome]],
    suspect: Callable[[list[Outcome]], bool],
) -> list[Outcome]:
    """One outcome per item, in order, given `outcomes` from forwarding `items` together.

    Unless `suspect(outcomes)`, those outcomes stand (the forward passed, or failed for a reason halving
    cannot help with). Otherwise each half is forwarded with `run` and isolated in turn, recursively; a
    single item keeps the failure it got alone.
    """
    if len(items) == 1 or not suspect(outcomes):
        return outcomes
    half = len(items) // 2
    results: list[Outcome] = []
    for part in (items[:half], items[half:]):
        results.extend(isolate(part, run(part), run, suspect))
    return results
