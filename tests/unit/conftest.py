"""Fixtures the unit tests share (their plain helpers are in ``tests.helpers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread while a test runs, the thread count restored after it: the family, runtime and batching tests
    ask for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
