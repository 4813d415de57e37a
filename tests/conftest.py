"""Test setup. Without a CUDA GPU the kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
triton is first imported, which is why it happens here, before any test module imports flashtile."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def poison(monkeypatch):
    """NaN-fill every buffer the kernel launchers allocate, so an element a kernel never writes fails the test.
    Returns the list of allocated shapes."""
    from flashtile.kernels import _common

    shapes = []

    def nan_empty(shape, dtype, device):
        shapes.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "empty", nan_empty)
    return shapes


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
