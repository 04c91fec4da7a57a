"""Sluice tests: unit (pure), integration (real servers on loopback), e2e (the CLI)."""
