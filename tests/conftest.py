"""Shared pytest fixtures. Keep this file generic: fixtures here apply to every test module."""

from __future__ import annotations

import logging
import os

import pytest
import torch

# torch's structured-trace logger ("torch.__trace", tlparse's input) is always at DEBUG and does not propagate;
# torch builds and writes a trace record whenever the logger has a handler. pytest 9 attaches its log capture to
# every non-propagating logger, which turned the trace on in every test: its payloads built at each compile and
# hundreds of "DEBUG torch.__trace" lines in each report of captured logs (all that the interpreter suites' parent
# could show of a failure). Unless a trace was asked for (TORCH_TRACE), drop torch's lazy trace handler and let
# the logger propagate, so that pytest leaves it alone and torch records nothing.
if not os.environ.get("TORCH_TRACE"):
    _trace = logging.getLogger("torch.__trace")
    for _handler in list(_trace.handlers):
        _trace.removeHandler(_handler)
    _trace.propagate = True


def pytest_configure(config):
    """One intra-op thread in each pytest-xdist worker and, through OMP_NUM_THREADS, in the processes its tests
    start (unless OMP_NUM_THREADS is set): the workers already fill the cores. With two threads per worker on the
    2-core CI machine, the threads of every small op spun waiting for cores that the other worker and the tests'
    torchrun processes held: ``-n 2`` of test_train.py took 268 s of CPU (260 s wall) with two threads, 114 s
    (97 s) with one; test_reliability.py 480 s with two, 295 s with one."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Modules whose single tests (those outside an xdist_group) take longest, slowest first: the interpreter suites'
# children (55-100 s each), the launcher and signal tests, the two-process trainer runs. pytest-xdist's loadgroup
# scheduler hands out a group of many tests before single tests and single tests in collection order; started
# first, the long ones no longer end the run on one worker while the other waits (about 45 s of the 2-core
# machine's 12 minutes, 2026-12-02).
LONG_FIRST = ("test_interpreter.py", "test_composition_layouts.py", "test_reliability.py", "test_train.py",
              "test_scripts.py")


def pytest_collection_modifyitems(config, items):
    """Collection order with the modules of :data:`LONG_FIRST` in front (a stable sort: the rest keep theirs)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` pytest-xdist appends each test's ``xdist_group`` to its id, which is how its
    scheduler keeps a group on one worker. Fail a grouped test whose id lacks it (pytest 9.2 with xdist 3.8 drops it
    silently, pytest-dev/pytest-xdist#1386) before its fixtures run, rather than make every group's shared runs on
    every worker."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail(f"the xdist_group mark is not in this test's id: pytest {pytest.__version__} and this "
                    "pytest-xdist do not group tests (pytest-dev/pytest-xdist#1386); install pytest<9.2 "
                    "(scripts/setup_env.sh)", pytrace=False)


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
