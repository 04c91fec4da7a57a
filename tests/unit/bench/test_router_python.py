"""bench/router_python.py drives the router's servicer, data plane, driver and core in process and prints
its Python CPU per request (or per refused request); every answer must be the fake worker's, every refusal
RESOURCE_EXHAUSTED."""

from __future__ import annotations

import sys

import pytest

from sluice_inference.bench import router_python


async def test_every_request_is_answered_by_the_worker_in_batches() -> None:
    figures = await router_python.measure(concurrency=8, rounds=10, repeats=2)
    assert figures.wrong == 0
    assert len(figures.us_per_request) == 2 and min(figures.us_per_request) > 0
    assert figures.rows_per_batch > 1  # requests handed over at once share batches


def test_it_prints_the_figure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["router_python", "--concurrency", "4", "--rounds", "5", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    router_python.main()
    line = capsys.readouterr().out.strip()
    assert line.startswith("router Python per request: ") and line.endswith(", 0 wrong answers")


async def test_a_tenant_over_its_rate_is_refused_every_time() -> None:
    figures = await router_python.measure(concurrency=8, rounds=10, repeats=2, refused=True)
    assert figures.wrong == 0  # every measured request refused RESOURCE_EXHAUSTED, none served
    assert len(figures.us_per_request) == 2 and min(figures.us_per_request) > 0
