"""Fixtures shared by several test modules, and the order tests run in."""

import pytest
import torch
from tiers import slow


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as the configs use: a second thread on a shared 2-core machine mostly
    waits. A module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items):
    """The slow tier (tests/tiers.py) marked `slow`; tests marked `long` first, the rest in their
    order: with `-n 2` the workers then end together, instead of one running a two-minute test
    alone at the end."""
    for item in items:
        if slow(item.nodeid):
            assert item.get_closest_marker("fast") is None, f"{item.nodeid}: fast and slow"
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
