"""Fixtures of the speculative decoding tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def flat_step_cost(monkeypatch):
    """Which drafts a step verifies follows the step cost measured at start-up, which a busy machine moves;
    with this every offered draft is verified, so each run drafts alike (tests/server and the benchmarks
    keep the measured cost)."""
    from engine.speculative import StepCost

    monkeypatch.setattr(StepCost, "measure", classmethod(lambda cls, runner, sizes=None: cls.flat()))
