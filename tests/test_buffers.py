"""broadcast_buffers: DDP's buffer rule, fused broadcasts, errors on every rank; SyncBatchNorm refused.

The MPI side (bitwise equal to torch DDP over gloo on 2 ranks) runs in
tests/test_synchronize.py's mpiexec jobs (tests/sync_job.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distutils_ml as dml

from sync_job import bn_model, buffers_eval_body, sync_batchnorm_body


def count_calls(b: dml.Backend, name: str) -> list[tuple]:
    """Record every call of primitive ``name`` on ``b`` (the buffer's dtype and size where there is one)."""
    calls: list[tuple] = []
    original = getattr(b, name)

    def counting(*args: Any) -> Any:
        buf = args[0]
        calls.append((str(buf.dtype), buf.size) if isinstance(buf, np.ndarray) else (None, None))
        return original(*args)

    setattr(b, name, counting)
    return calls


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """A torch.distributed group of one rank in this process, for a DDP reference."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


STEPS = st.lists(st.tuples(st.sampled_from(["train", "eval"]), st.booleans()), min_size=1, max_size=10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_syncs_exactly_when_ddp_does(gloo_world_of_one: None, steps: list[tuple[str, bool]]) -> None:
    # Any sequence of forwards (train or eval mode, gradients enabled or not): our hook
    # broadcasts before exactly the forwards before which DDP broadcasts its buffers.
    b = dml.LocalBackend()
    ours = bn_model(0)
    handle = dml.broadcast_buffers(b, ours)
    bcasts = count_calls(b, "_bcast")
    ddp = torch.nn.parallel.DistributedDataParallel(bn_model(0))
    ddp_syncs: list[int] = []
    original = ddp._sync_buffers

    def counting() -> None:
        ddp_syncs.append(1)
        original()

    ddp._sync_buffers = counting  # type: ignore[method-assign]
    x = torch.randn(4, 3)
    schedule_ours, schedule_ddp = [], []
    for mode, grad in steps:
        for model, calls, schedule in ((ours, bcasts, schedule_ours), (ddp, ddp_syncs, schedule_ddp)):
            before = len(calls)
            model.train(mode == "train")
            with torch.set_grad_enabled(grad):
                out = model(x)
            if grad:
                out.sum().backward()
            schedule.append(len(calls) > before)
    assert schedule_ours == schedule_ddp, (steps, schedule_ours, schedule_ddp)
    assert len(bcasts) == 2 * sum(schedule_ours), "one broadcast per dtype (float32 statistics, int64 counter)"
    handle.remove()


def test_schedule_after_training() -> None:
    # The rule spelled out: every training forward syncs; the first evaluation forward under
    # no_grad syncs, the next ones do not; neither does the first training forward after them.
    b = dml.LocalBackend()
    model = bn_model(0)
    handle = dml.broadcast_buffers(b, model)
    bcasts = count_calls(b, "_bcast")
    synced = []
    for mode, grad in [("train", True), ("train", True), ("eval", False), ("eval", False), ("train", True)] * 2:
        before = len(bcasts)
        model.train(mode == "train")
        with torch.set_grad_enabled(grad):
            model(torch.randn(4, 3))
        synced.append(len(bcasts) > before)
    assert synced == [True, True, True, False, False] * 2, synced
    handle.remove()
    model(torch.randn(4, 3))
    assert len(bcasts) == 2 * 6, "remove() stops the broadcasts"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_buffers_are_roots(world: int) -> None:
    dml.LocalBackend.spawn(world, buffers_eval_body, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sync_batchnorm_fails_loudly(world: int) -> None:
    dml.LocalBackend.spawn(world, sync_batchnorm_body, timeout=60)


def test_sync_batchnorm_allowed_with_a_process_group(gloo_world_of_one: None) -> None:
    # With torch.distributed initialized, SyncBatchNorm has its group: nothing to refuse.
    def fn(b: dml.Backend) -> None:
        model = bn_model(0, sync_bn=True)
        dml.synchronize(b, model)
        dml.broadcast_buffers(b, model).remove()

    dml.LocalBackend.spawn(2, fn, timeout=60)


@pytest.mark.parametrize("world", [2, 3])
def test_different_buffers_raise_on_every_rank(world: int) -> None:
    class Counter(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    def fn(b: dml.Backend) -> list[str]:
        messages = []
        model = Counter(3 if b.rank == 1 else 2)
        with pytest.raises(ValueError, match="hold buffers that differ from root 0's") as info:
            dml.broadcast_buffers(b, model)
        messages.append(str(info.value))
        model = Counter(2)
        handle = dml.broadcast_buffers(b, model)
        model(torch.ones(1))
        if b.rank == world - 1:  # a buffer replaced on one rank only: the next sync refuses, nothing is sent
            model.seen = torch.zeros(2, dtype=torch.float64)
        bcasts = count_calls(b, "_bcast")
        with pytest.raises(ValueError, match="hold buffers that differ from root 0's") as info:
            model(torch.ones(1))
        assert bcasts == []
        messages.append(str(info.value))
        handle.remove()
        return messages

    messages = dml.LocalBackend.spawn(world, fn, timeout=60)
    for first, later in messages:
        assert "rank 1: module.seen is an array of shape (3,), dtype float32 on cpu, root's module.seen is " in first
        assert f"rank {world - 1}: module.seen is an array of shape (2,), dtype float64" in later, later


def test_without_buffers_no_collective() -> None:
    def fn(b: dml.Backend) -> None:
        model = torch.nn.Linear(3, 2)
        handle = dml.broadcast_buffers(b, model)
        calls = count_calls(b, "_allgather") + count_calls(b, "_bcast")
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
        assert calls == [] and count_calls(b, "_bcast") == []
        handle.remove()

    dml.LocalBackend.spawn(2, fn, timeout=60)


def test_saved_buffers_keep_their_version() -> None:
    # An eval-mode forward with gradients saves the running variance for backward; the next
    # forward's broadcast writes it in place, and the first backward must still work (as in DDP).
    def fn(b: dml.Backend) -> None:
        model = bn_model(b.rank).eval()
        dml.synchronize(b, model)
        handle = dml.broadcast_buffers(b, model)
        x = torch.randn(4, 3, requires_grad=True)
        first = model(x)
        model(x)  # syncs: the previous forward ran with gradients enabled
        first.sum().backward()
        assert x.grad is not None
        handle.remove()

    dml.LocalBackend.spawn(2, fn, timeout=60)


def test_bad_arguments_raise_before_any_communication() -> None:
    b = dml.LocalBackend()
    with pytest.raises(TypeError, match=r"module: got builtins\.dict; allowed: a torch\.nn\.Module"):
        dml.broadcast_buffers(b, {"w": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="root: got 1"):
        dml.broadcast_buffers(b, torch.nn.BatchNorm1d(2), root=1)
    with pytest.raises(TypeError, match="first argument must be a backend"):
        dml.broadcast_buffers(torch.nn.BatchNorm1d(2), b)  # type: ignore[arg-type]
