"""Fixtures shared by the replay test modules."""

import pytest
import torch


@pytest.fixture
def no_cudnn_benchmark():
    """cuDNN benchmark off for the test (bitwise replay-vs-eager comparisons need the same kernel
    choices on both paths), restored afterwards."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cudnn.benchmark = old
