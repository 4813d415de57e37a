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


@pytest.fixture
def call_counter(monkeypatch):
    """count(module, name): replace module.name by a wrapper that records each call's first argument's shape;
    returns the record. The compile-ahead is off (SETTINGS.compile_ahead): its helper would run a counted backward
    builder once more, on stand-ins (flashtile/_ahead.py)."""
    from flashtile._settings import SETTINGS
    monkeypatch.setattr(SETTINGS, "compile_ahead", False)

    def count(module, name):
        calls = []
        launch = getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls
    return count


@pytest.fixture
def spy(monkeypatch, call_counter):
    """The calls that reach the Hopper Gluon forward (kernels/hopper_fwd.py). Plans off (SETTINGS.fast_launch):
    every call builds its launch, so each one is counted."""
    from flashtile._settings import SETTINGS
    from flashtile.kernels import hopper_fwd
    monkeypatch.setattr(SETTINGS, "fast_launch", False)
    return call_counter(hopper_fwd, "plan_forward")


@pytest.fixture
def bwd_spy(monkeypatch, call_counter):
    """The calls that reach the Hopper Gluon backward, with it on (FLASHTILE_GLUON_BWD=0 turns it off) at every
    size (d64 varlen batches of short mean length past the persistent grid's bound normally take the portable
    kernels). Plans off, as for spy."""
    from flashtile._settings import SETTINGS
    from flashtile.kernels import hopper_bwd
    monkeypatch.setattr(SETTINGS, "gluon_backward", True)
    monkeypatch.setattr(SETTINGS, "fast_launch", False)
    from flashtile import dispatch
    monkeypatch.setattr(dispatch, "GLUON_BWD_MIN_SEQLEN_K", dict.fromkeys(dispatch.GLUON_KERNEL_DIMS, 0))
    return call_counter(hopper_bwd, "gluon_plan")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    elif torch.cuda.get_device_capability()[0] != 9:
        skip = pytest.mark.skip(reason="the Gluon kernels are compiled for Hopper (sm_90) only")
        for item in items:
            if "hopper" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def bwd_grids(monkeypatch):
    """For each launch of the Hopper Gluon backward, in order: whether it ran the persistent grid
    (hopper_bwd.GluonBwdPlan.persistent)."""
    from flashtile.kernels import hopper_bwd
    persistent = []
    run = hopper_bwd.GluonBwdPlan.run

    def recorded(self, *args, **kwargs):
        persistent.append(self.persistent)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(hopper_bwd.GluonBwdPlan, "run", recorded)
    return persistent
