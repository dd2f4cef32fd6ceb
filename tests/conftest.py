"""Shared pytest fixtures. Keep this file generic: fixtures here apply to every test module."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_torch_rng():
    """Seed torch's global RNG before each test and restore it afterwards.

    Tests then do not depend on the order they run in, and a test that draws random numbers cannot change
    what the next one draws.
    """
    state = torch.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
