"""``DistributedOptimizer(step_during_backward=True)`` (distutils_ml/stepping.py): each bucket's parameters are
stepped as its reduction lands, bit-identical to stepping after backward; what cannot be exact raises.

The bodies live in tests/stepping_bodies.py; tests/stepping_job.py runs them under mpiexec (MPI, and gloo with
overlap: the steps then run on the communication thread while later buckets are on the wire).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import shared
import stepping_bodies as sb
from mpirun import assert_checks_passed, requires_mpi, run_mpi


@settings(max_examples=40, deadline=None)
@given(case=sb.step_cases(), world=st.integers(1, 4))
def test_stepping_during_backward_is_bit_identical_to_stepping_after(case: sb.StepCase, world: int) -> None:
    dml.LocalBackend.spawn(world, sb.equivalence_body, case)


@pytest.mark.parametrize("what", ["clip", "scaler", "replaced", "in_place", "data_assigned", "twice", "closure", "lr"])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("shard", [False, True])
def test_what_cannot_be_exact_raises_on_every_rank(shard: bool, world: int, what: str) -> None:
    messages = dml.LocalBackend.spawn(world, sb.errors_body, what, shard)
    assert len(messages) == world


def _flipped_order_body(backend: dml.Backend, bucket_bytes: int) -> str:
    """All parameters used everywhere, the loss's terms in another order on the last rank: the order check's error
    names the parameters, read while the stepping thread may still hold a bucket's subset of the groups."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.nn.Linear(4, n).double() for n in (4, 4, 3))
    params = [p for m in (a, b, c) for p in m.parameters()]
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    _opt = dml.DistributedOptimizer(  # kept: its hooks reduce the backward
        backend, torch.optim.SGD(params, lr=0.1), step_during_backward=True, overlap=True, bucket_bytes=bucket_bytes
    )
    x = torch.ones(2, 4, dtype=torch.float64) * (backend.rank + 1)
    if backend.rank == backend.size - 1:  # the forward, and so the backward, in another order
        loss = c(torch.tanh(b(x))).pow(2).mean() + a(x).pow(2).mean()
    else:
        loss = a(x).pow(2).mean() + c(torch.tanh(b(x))).pow(2).mean()
    try:
        loss.backward()
    except RuntimeError as e:
        assert "gradients became ready in a different order on different ranks" in str(e), e
        return "refused"
    return "accepted"


@pytest.mark.parametrize("bucket_bytes", [0, 64])
def test_an_order_differing_across_ranks_is_named_while_buckets_step(bucket_bytes: int) -> None:
    for _ in range(3):  # the stepping thread's timing varies
        assert dml.LocalBackend.spawn(2, _flipped_order_body, bucket_bytes, timeout=60) == ["refused"] * 2


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shard", [False, True])
def test_loading_a_state_between_a_stepping_backward_and_step_is_refused(shard: bool, overlap: bool) -> None:
    for side_everywhere in (True, False):
        messages = dml.LocalBackend.spawn(3, sb.load_between_body, shard, overlap, side_everywhere)
        assert len(messages) == 3


def test_a_state_loads_before_step_while_the_gradients_are_rescaled() -> None:
    dml.LocalBackend.spawn(3, sb.load_while_rescaled_body)


@pytest.mark.parametrize("shard", [False, True])
def test_a_checkpoint_loads_after_a_backward_whose_step_raised(shard: bool) -> None:
    dml.LocalBackend.spawn(3, sb.load_after_failed_round_body, shard)


@pytest.mark.parametrize("setting", ["step_during_backward", "prefetch"])
def test_sharded_ranks_that_differ_in_when_the_allgathers_go_are_refused(setting: str) -> None:
    messages = dml.LocalBackend.spawn(2, sb.sharded_agreement_body, setting)
    assert len(messages) == 2


@pytest.mark.parametrize(("shard", "overlap"), [(False, False), (False, True), (True, False), (True, True)])
def test_a_rank_whose_backward_reaches_no_parameter(shard: bool, overlap: bool) -> None:
    dml.LocalBackend.spawn(2, sb.no_hook_body, shard, overlap, timeout=60)


@pytest.mark.parametrize("shard", [False, True])
def test_a_round_left_open_by_reentrant_checkpointing_is_completed_by_step(shard: bool) -> None:
    dml.LocalBackend.spawn(2, sb.reentrant_body, shard, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_step_that_fails_on_one_rank_raises_on_every_rank(world: int, overlap: bool) -> None:
    messages = dml.LocalBackend.spawn(world, sb.failing_step_body, overlap, timeout=60)
    assert len(messages) == world


@pytest.mark.parametrize(("shard", "during"), [(False, False), (False, True), (True, False), (True, True)])
def test_step_after_a_backward_that_raised_part_way_refuses(shard: bool, during: bool) -> None:
    dml.LocalBackend.spawn(2, sb.unfinished_backward_body, shard, during, timeout=60)


def test_a_sharded_reduction_outside_backward_steps_and_is_checked() -> None:
    dml.LocalBackend.spawn(2, sb.synchronize_body, timeout=60)


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_failing_at_the_end_of_backward_raises_on_every_rank(world: int) -> None:
    messages = dml.LocalBackend.spawn(world, sb.failing_rest_body, timeout=60)
    assert len(messages) == world


def test_a_disabled_sharded_grad_scaler_is_accepted() -> None:
    dml.LocalBackend.spawn(2, sb.disabled_scaler_body, timeout=60)


def test_optimizers_that_couple_parameters_prefetch_and_join_are_refused() -> None:
    def body(backend: dml.Backend) -> None:
        model = torch.nn.Linear(3, 2)
        with pytest.raises(TypeError, match="LBFGS"):
            dml.DistributedOptimizer(backend, torch.optim.LBFGS(model.parameters()), step_during_backward=True)
        with pytest.raises(TypeError, match="step_during_backward=True with prefetch=True"):
            dml.DistributedOptimizer(
                backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True, step_during_backward=True,
                prefetch=True,
            )  # fmt: skip
        with pytest.raises(TypeError, match="step_during_backward: got 1"):
            dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), step_during_backward=1)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), step_during_backward=True)
        with pytest.raises(TypeError, match="step_during_backward=True, which join does not support"):
            dml.join(backend, opt, model)

    dml.LocalBackend.spawn(2, body)


STEPPING_JOB = shared.register("stepping", "stepping_job", timeout=240)


@requires_mpi
@pytest.mark.parametrize(
    ("ranks", "transport", "debug"),
    [
        pytest.param(2, "mpi", False, marks=pytest.mark.shared_job(STEPPING_JOB)),  # one host's defaults
        (3, "mpi", True),
        (2, "gloo", False),
        (3, "gloo", True),
    ],
)
def test_stepping_during_backward_under_mpiexec(ranks: int, transport: str, debug: bool) -> None:
    """The bodies under mpiexec; with 3 ranks in debug mode too, where a rank whose backward reached no parameter
    reduces in step() what the others reduced in backward, as one call site (a CollectiveMismatchError before)."""
    env = {"DML_TRANSPORT": transport, "DML_OVERLAP": "1" if transport == "gloo" else "0", "DML_DEBUG": str(int(debug))}
    if (transport, debug) == ("mpi", False):  # MPI without overlap nor debug mode: the shared job's environment
        job = shared.job(ranks, STEPPING_JOB)
    else:
        job = run_mpi(ranks, ["tests/stepping_job.py"], timeout=240, envs=[env] * ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert f"STEPPING CHECKS PASSED: equivalence errors on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, ["equivalence", "errors"], ranks)


def _adamw_run(backend: dml.Backend, shard: bool, during: bool) -> torch.Tensor:
    """Three AdamW steps of a small MLP through DistributedOptimizer; the parameters after them."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = dml.DistributedOptimizer(
        backend, adamw, bucket_bytes=1024, overlap=True, shard_state=shard, step_during_backward=during
    )
    data = torch.Generator().manual_seed(10 + dml.local_rank(backend))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=data)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(("shard", "during"), [(False, False), (False, True), (True, False), (True, True)])
def test_steps_taken_while_another_thread_compiles_are_the_same_bits(shard: bool, during: bool) -> None:
    """torch.compiler.is_compiling() is one flag for the process, and torch.optim's AdamW computes its bias
    corrections differently while it is set: a step taken while another thread compiles (another simulated rank,
    or this rank's main thread while the stepping thread steps) must wait for the compilation, or the replicas
    differ in the last bits (as tests/test_compile.py's whole-step case did, now and then, under load)."""
    alone = dml.LocalBackend.spawn(2, _adamw_run, shard, during)
    compiling, release = threading.Event(), threading.Event()

    def blocking_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiling.set()  # Dynamo is inside its compilation: the flag is set, its lock held
        release.wait(30)
        return gm.forward

    compiler = threading.Thread(target=torch.compile(lambda x: x * 3, backend=blocking_backend), args=(torch.ones(2),))
    torch._dynamo.reset()
    compiler.start()
    try:
        assert compiling.wait(30), "the compilation did not start"
        assert torch.compiler.is_compiling(), "the flag this test is about is not set for other threads"
        threading.Timer(1.0, release.set).start()  # the steps below take milliseconds: they meet the compilation
        meanwhile = dml.LocalBackend.spawn(2, _adamw_run, shard, during)
    finally:
        release.set()
        compiler.join(30)
        torch._dynamo.reset()
    for a, b in zip(alone, meanwhile, strict=True):
        assert torch.equal(a, b), f"a step taken during a compilation differs by {float((a - b).abs().max())}"


def test_zero_grad_after_a_backward_that_stepped_raises() -> None:
    """A loop that discards a backward (an input gradient, FGSM; a GAN generator's pass through the discriminator)
    stepped that backward's buckets already: zero_grad() then raises on every rank (it stepped twice, silently)."""

    def body(b: dml.Backend) -> list[float]:
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1), step_during_backward=True)
        x = torch.ones(1, 2, requires_grad=True)
        model(x).sum().backward()  # for x.grad only
        with pytest.raises(RuntimeError, match="zero_grad\\(\\) after a backward that already stepped"):
            opt.zero_grad()
        opt.zero_grad()  # told once: the next one goes on
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()  # after a step: nothing to say
        return model.weight.detach().reshape(-1).tolist()

    assert dml.LocalBackend.spawn(2, body) == [[pytest.approx(0.8)] * 2] * 2
