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


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny shapes: on a busy 2-core machine extra threads only add
    synchronisation (decoding steps ran about 100x slower with 2 threads while other processes were busy).
    Use with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
