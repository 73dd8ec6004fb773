"""Shared fixtures of the CPU unit tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread (small shapes: threads only add contention), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
