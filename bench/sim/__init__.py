"""The discrete-event simulator behind `sluice sim` (docs/batching.md).

It drives the router's own policy objects (`sluice_inference.router.policy`: admission, lanes, batcher,
scheduler, estimators) under virtual time, with simulated workers that follow a latency profile t(b) = a + c·b
and open-loop arrivals from the load generator's schedule code. Nothing here makes a scheduling decision:
every decision comes from the same objects the asyncio shell (`router/driver.py`) drives, so what the
simulator shows is what the router does, minus the network and Python overheads it models as constants.

Modules: `scenario` (the YAML schema), `plan` (one run's arrivals and lanes), `workers` (devices), `engine`
(the event loop, the second driver of the core), `results` (outcomes and tables), `experiments` (policy
comparisons and load sweeps), `plots` (optional matplotlib figures), `validate` (sim vs a real
cluster).
"""
