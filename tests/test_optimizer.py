"""DistributedOptimizer and allreduce_gradients on LocalBackend.spawn, and under mpiexec (tests/optimizer_job.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import shared
from mpirun import assert_checks_passed, requires_mpi
from train_bodies import (
    ConfigCase,
    TrainCase,
    accumulation_body,
    check_warnings,
    closure_body,
    compression_body,
    config_cases,
    config_mismatch_body,
    late_backward_body,
    make_model,
    sparse_gradient_body,
    train_body,
    train_cases,
    unused_parameters_body,
)


@settings(max_examples=30, deadline=None)
@given(case=train_cases(), world=st.integers(1, 4))
def test_data_parallel_equals_big_batch(case: TrainCase, world: int) -> None:
    flats = dml.LocalBackend.spawn(world, train_body, case, timeout=60)
    assert all(f == flats[0] for f in flats), "replicas must be bitwise identical"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_unused_parameters_never_hang(world: int) -> None:
    flats = dml.LocalBackend.spawn(world, unused_parameters_body, 5, timeout=30)
    assert all(f == flats[0] for f in flats)


@pytest.mark.parametrize("world", [1, 3])
def test_no_sync_and_synchronize_reduce_once(world: int) -> None:
    dml.LocalBackend.spawn(world, accumulation_body, 3, timeout=30)


def test_communication_dtype() -> None:
    dml.LocalBackend.spawn(3, compression_body, 1, timeout=30)


def test_allreduce_gradients_of_module() -> None:
    def fn(b: dml.Backend) -> list[float]:
        model = make_model(0, bn=False)
        model(torch.full((2, 3), float(b.rank))).sum().backward()
        dml.allreduce_gradients(b, model)
        return model[0].weight.grad.reshape(-1).tolist()

    out = dml.LocalBackend.spawn(2, fn)
    ref = make_model(0, bn=False)
    for r in range(2):
        (ref(torch.full((2, 3), float(r))).sum() / 2).backward()
    assert out[0] == out[1]
    torch.testing.assert_close(torch.tensor(out[0]), ref[0].weight.grad.reshape(-1))


def test_wrapper_is_an_optimizer_and_forwards() -> None:
    b = dml.LocalBackend()
    model = make_model(0, bn=False)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = dml.DistributedOptimizer(b, inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    sd = opt.state_dict()
    assert sd["state"], "momentum buffers exist after a step"
    fresh = torch.optim.SGD(make_model(1, bn=False).parameters(), lr=1.0, momentum=0.9)
    dml.DistributedOptimizer(b, fresh).load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert inner.param_groups[-1]["params"] == [extra]
    dml.synchronize(b, opt)  # the wrapper works as well as the wrapped optimizer


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"optimizer": "sgd"}, TypeError, "optimizer: got str"),
        ({"op": "mean"}, ValueError, "op: got 'mean'"),
        ({"bucket_bytes": -1}, ValueError, "bucket_bytes: got -1"),
        ({"communication_dtype": torch.int8}, ValueError, "communication_dtype"),
    ],
)
def test_bad_arguments(kwargs: dict, exc: type, fragment: str) -> None:
    model = make_model(0, bn=False)
    args = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)} | kwargs
    optimizer = args.pop("optimizer")
    with pytest.raises(exc, match=fragment):
        dml.DistributedOptimizer(dml.LocalBackend(), optimizer, **args)


def test_backend_first() -> None:
    with pytest.raises(TypeError, match="first argument must be a backend"):
        dml.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), dml.LocalBackend())


def test_small_gradients_become_bucket_views_and_are_not_copied_again() -> None:
    def fn(b: dml.Backend) -> list[int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
        big, small = [model[0].weight], [model[0].bias, model[2].weight, model[2].bias]
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=64 * 1024)
        ptrs = []
        for step in range(3):
            opt.zero_grad(set_to_none=step == 0)  # fresh gradients first, then kept ones
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            ptrs.append([p.grad.data_ptr() for p in small + big])
        storage = {p.grad.untyped_storage().data_ptr() for p in small}
        assert len(storage) == 1, "small gradients share one bucket"
        assert big[0].grad.untyped_storage().data_ptr() not in storage, "large gradients stay in place"
        assert ptrs[0] == ptrs[1] == ptrs[2], "kept gradients are reduced where they are, never re-copied"
        flats = [b.flat for b in opt._reducer._buckets if b.flat is not None]
        bucket_bytes = sum(t.numel() * t.element_size() for t in flats)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        header = len(small + big) + 1 + 3 * len(opt._reducer._buckets)  # flags, changed mark, ready order
        assert bucket_bytes <= param_bytes + 4 * header, "at most one gradient-sized extra buffer"
        return [round(float(p.grad.abs().sum()) * 1e4) for p in small + big]

    out = dml.LocalBackend.spawn(2, fn)
    assert out[0] == out[1]


def test_step_and_state_dict_hooks_work_on_the_wrapper() -> None:
    model = make_model(0, bn=False)
    opt = dml.DistributedOptimizer(dml.LocalBackend(), torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append(f"pre {o is opt}"))
    opt.register_step_post_hook(lambda o, a, k: calls.append(f"post {o is opt}"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("state_dict") or sd)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load"))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    pre.remove()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre True", "post True", "post True", "state_dict", "load"]


# -- issue 11 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_backward_after_synchronize_is_reduced_again_or_refused(world: int) -> None:
    with warnings.catch_warnings(record=True) as recorded:  # process-wide: records every rank thread's warnings
        warnings.simplefilter("always")
        expected = dml.LocalBackend.spawn(world, late_backward_body, 3, timeout=60)
    check_warnings([fragment for mine in expected for fragment in mine], recorded)


@settings(max_examples=40, deadline=None)
@given(case=config_cases(), world=st.integers(2, 4))
def test_configuration_differing_on_one_rank_raises_on_every_rank(case: ConfigCase, world: int) -> None:
    dml.LocalBackend.spawn(world, config_mismatch_body, case, timeout=60)


def _counting(backend: dml.Backend, counts: dict[str, int], name: str) -> None:
    """Count this rank's calls of the backend primitive ``name`` (the collective still runs)."""
    primitive = getattr(backend, name)

    def counted(*args: Any) -> Any:
        counts[name] += 1
        return primitive(*args)

    setattr(backend, name, counted)


def test_configuration_is_compared_only_when_the_plan_is_built() -> None:
    def fn(b: dml.Backend) -> list[int]:
        counts = {"_allgather": 0, "_allgather_bytes": 0}
        for name in counts:
            _counting(b, counts, name)

        def gathers() -> int:
            return sum(counts.values())

        model = make_model(0, bn=False)
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            seen.append(gathers())
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})  # a new plan, compared again
        opt.step()
        seen.append(gathers())
        opt.synchronize()  # the step after a synchronize() agrees on whether a backward came in between
        opt.step()
        seen.append(gathers())
        for _ in range(3):
            dml.allreduce_gradients(b, model)
            seen.append(gathers())
        return seen

    assert dml.LocalBackend.spawn(2, fn) == [[1, 1, 1, 2, 3, 4, 4, 4]] * 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sparse_gradients_train_like_one_process(world: int) -> None:
    dml.LocalBackend.spawn(world, sparse_gradient_body, 4, timeout=60)


def test_sparse_adam_is_refused_only_with_sparse_as_dense() -> None:
    emb = torch.nn.Embedding(4, 2, sparse=True)
    with pytest.raises(TypeError, match=r"torch\.optim\.SparseAdam, which needs sparse gradients, with sparse_as_d"):
        dml.DistributedOptimizer(dml.LocalBackend(), torch.optim.SparseAdam(emb.parameters()), sparse_as_dense=True)
    dml.DistributedOptimizer(dml.LocalBackend(), torch.optim.SparseAdam(emb.parameters()))
    with pytest.raises(TypeError, match="sparse_as_dense: got 1"):
        dml.DistributedOptimizer(dml.LocalBackend(), torch.optim.SGD(emb.parameters(), lr=0.1), sparse_as_dense=1)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_step_with_closure_reduces_after_every_call(world: int) -> None:
    losses = dml.LocalBackend.spawn(world, closure_body, 5, timeout=60)
    assert all(loss == losses[0] for loss in losses), "every rank sees the same reduced loss"


OPTIMIZER_JOB = shared.register("optimizer", "optimizer_job", timeout=180)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(OPTIMIZER_JOB)
def test_optimizer_job_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, OPTIMIZER_JOB)
    assert job.returncode == 0, job.output[-8000:]
    checks = "late_backward config sparse closure"
    assert f"OPTIMIZER CHECKS PASSED: {checks} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, checks.split(), ranks)


@pytest.mark.parametrize("how", ["no_sync", "backward_passes_per_step"])
@pytest.mark.parametrize("world", [2, 3])
def test_sum_of_reduced_and_then_accumulated_gradients_is_refused_by_synchronize_too(world: int, how: str) -> None:
    """op=SUM, a reducing backward, then one that only accumulates: step() and synchronize() both refuse to reduce
    again (it would count the first gradients W times), on every rank; AVG reduces the sum exactly."""

    def run(b: dml.Backend, op: Any, via: str) -> list[float] | str:
        w = torch.nn.Parameter(torch.zeros(3))
        opt = dml.DistributedOptimizer(
            b, torch.optim.SGD([w], lr=1.0), op=op, backward_passes_per_step=2 if how != "no_sync" else 1
        )
        r = dml.local_rank(b) + 1
        if how != "no_sync":
            (w * r).sum().backward()  # only accumulates: the first of two passes
        (w * r).sum().backward()  # reduces
        if how == "no_sync":
            with opt.no_sync():
                (w * 10 * r).sum().backward()
        else:
            (w * 10 * r).sum().backward()  # the first pass of the next step: accumulates
        try:
            if via == "synchronize":
                opt.synchronize()
            opt.step()
        except RuntimeError as e:
            return str(e)
        return w.detach().tolist()

    ranks = sum(range(1, world + 1))
    for via in ("step", "synchronize"):
        out = dml.LocalBackend.spawn(world, run, dml.SUM, via, timeout=30)
        assert all(isinstance(o, str) and "accumulated into inside no_sync()" in o for o in out), (via, out)
        assert all(f"DistributedOptimizer.{via}()" in o for o in out), (via, out)
        avg = dml.LocalBackend.spawn(world, run, dml.AVG, via, timeout=30)
        first = 2 * ranks / world if how != "no_sync" else ranks / world  # the reduced backward(s)' average
        assert avg == [[-(first + 10 * ranks / world)] * 3] * world, (via, avg)


def test_complex_parameters_are_refused_with_the_way_around() -> None:
    # On this thread: an error raised inside a simulated rank's backward can abort the process at its exit.
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = dml.DistributedOptimizer(dml.LocalBackend(), torch.optim.SGD([p], lr=0.1))
    with pytest.raises(TypeError, match="complex parameters are not reduced: hold them as real ones"):
        (p.abs() ** 2).sum().backward()
    del opt
