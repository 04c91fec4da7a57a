"""A worker owns one device: it loads model versions from the repository, warms them up, registers them
under its etcd lease, and executes the batches routers send it, one forward pass at a time.

Layout: `model_config` (typed `config.yaml`), `repository` (scan, version policy, digests), `backends/`
(torch.export, TorchScript, simulated), `executor` (validate, batch, forward, split). The gRPC shell and
entry point sit on top of these; nothing here imports `router`.
"""
