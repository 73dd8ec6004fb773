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


@pytest.fixture(scope="module")
def pg():
    """A 1-process gloo group for the in-process FSDP tests of one module."""
    from slipstream.engine.distributed import destroy_distributed, init_distributed

    init_distributed("cpu")
    yield
    destroy_distributed()
