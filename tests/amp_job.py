"""The bodies of tests/test_amp.py (``dml.ShardedGradScaler``), and their MPI job:
``mpiexec -n N python tests/amp_job.py [CHECK...]``.

LocalBackend.spawn runs the bodies in pytest; under mpiexec every rank runs the same bodies (this file's
``main``), and rank 0 ends with ``AMP CHECKS PASSED``. Float16 autocast is not available on the CPU for every op,
so the bodies test the scaler's logic directly: float32 models whose scaled gradients are made inf or NaN on one
rank only (``Event``), in one element that may lie in any rank's shard, or made to overflow only when the ranks'
gradients are summed (``"reduced"``: finite on every rank, inf in the shard of the rank that owns the element:
the case a check of each rank's own ``.grad`` misses). Each run is compared with the unsharded
``DistributedOptimizer`` under torch's own ``GradScaler``, fed the same data: the same steps skipped, the same
scales, the same parameters (bit for bit where the sums are the same, LocalBackend and 2 MPI ranks; within
``TOLERANCE`` on 3 or more MPI ranks, whose ``Reduce_scatter`` and ``Allreduce`` may add in other orders).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

import distutils_ml as dml

#: Ways a step's scaled gradients become non-finite: on rank ``rank`` only, the whole loss times inf ("loss"),
#: or one element inf / NaN ("inf", "nan"); on every rank, one element finite but summing to inf ("reduced").
KINDS = ("loss", "inf", "nan", "reduced")
#: (kind, rank (modulo the world size), element of the parameters concatenated in model order)
Event = tuple[str, int, int]
NUMEL = 6 * 5 + 5 + 5 * 3 + 3
#: (rtol, atol) where the sums may add in other orders (3 or more MPI ranks)
TOLERANCE = (1e-4, 1e-5)
INIT_SCALE = 2.0**8


@dataclass(frozen=True)
class AmpCase:
    """One training run: each step's events, and how the optimizer and the loop are set up."""

    steps: tuple[tuple[Event, ...], ...]
    op: str = "avg"
    overlap: bool = False
    unscale_first: bool = False  # scaler.unscale_(opt) before scaler.step(opt) (as before clipping)
    #: "no": one batch; "last_outside": two micro-batches, the first inside opt.no_sync() (its events too);
    #: "all_inside": both inside, so the scaler reduces them (the reference calls opt.synchronize() for torch's)
    accumulate: str = "no"
    bucket_bytes: int | None = None  # None: one bucket; 64: several


def amp_cases() -> st.SearchStrategy[AmpCase]:
    event = st.tuples(st.sampled_from(KINDS), st.integers(0, 3), st.integers(0, NUMEL - 1))
    step = st.one_of(st.just(()), st.lists(event, min_size=1, max_size=2).map(tuple))
    return st.builds(
        AmpCase,
        steps=st.lists(step, min_size=2, max_size=6).map(tuple),
        op=st.sampled_from(["avg", "sum"]),
        overlap=st.booleans(),
        unscale_first=st.booleans(),
        accumulate=st.sampled_from(["no", "last_outside", "all_inside"]),
        bucket_bytes=st.sampled_from([None, 64]),
    )


def make_model() -> nn.Module:
    """The same small MLP on every rank and in every run (initialized from its own generator)."""
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _exact(backend: dml.Backend) -> bool:
    """Whether reduce-scatter and allreduce add alike here (LocalBackend; any backend on 2 ranks)."""
    return isinstance(backend, dml.LocalBackend) or backend.size <= 2


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=TOLERANCE[0], atol=TOLERANCE[1])


def _loss(model: nn.Module, x: torch.Tensor, events: tuple[Event, ...], backend: dml.Backend, scale: float) -> Any:
    """The batch's loss, with the terms that make this step's scaled gradients non-finite on this rank."""
    rank, world = backend.rank, backend.size
    loss = model(x).pow(2).mean()
    flat = torch.cat([p.reshape(-1) for p in model.parameters()])
    for kind, who, element in events:
        if kind == "reduced":  # every rank: 2e38 once scaled; the sum over 2 or more ranks overflows float32
            loss = loss + flat[element] * (2e38 / scale if world > 1 else math.inf)
        elif who % world == rank:
            if kind == "loss":
                loss = loss * math.inf
            else:
                loss = loss + flat[element] * (math.inf if kind == "inf" else math.nan)
    return loss


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


@dataclass
class Run:
    skipped: list[bool]
    scales: list[float]
    finite_here: list[bool]  # whether this rank's whole .grad was finite after backward (torch's local check)
    params: torch.Tensor
    grads: list[tuple[torch.Tensor, torch.Tensor] | None]  # after unscale_ of an event-free step: .grad, own


def train(backend: dml.Backend, case: AmpCase, sharded: bool) -> Run:
    """``case`` with the sharded optimizer and dml.ShardedGradScaler, or the unsharded one and torch's GradScaler."""
    model = make_model()
    plain = make_model()  # this rank's own gradients, unreduced
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = dml.DistributedOptimizer(
        backend, sgd, op=case.op, overlap=case.overlap, bucket_bytes=case.bucket_bytes, shard_state=sharded
    )
    scaler: torch.amp.GradScaler = (
        dml.ShardedGradScaler(backend, "cpu", init_scale=INIT_SCALE, growth_interval=2)
        if sharded
        else torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    )
    stepped = [0]
    opt.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    run = Run([], [], [], torch.empty(0), [])
    micro_batches = 1 if case.accumulate == "no" else 2
    for s, events in enumerate(case.steps):
        scale = scaler.get_scale()
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        opt.zero_grad()
        for micro in range(micro_batches):
            inside = micro < micro_batches - 1 or case.accumulate == "all_inside"
            quiet = opt.no_sync() if inside else contextlib.nullcontext()
            x, here = _batch(backend.rank, s, micro), events if micro == 0 else ()
            with quiet:
                scaler.scale(_loss(model, x, here, backend, scale)).backward()
            (_loss(plain, x, here, backend, scale) * scale).backward()
        if case.accumulate == "all_inside" and not sharded:
            opt.synchronize()  # torch's GradScaler reads .grad as it is; ShardedGradScaler reduces it first
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        run.finite_here.append(all(bool(torch.isfinite(g).all()) for g in grads))
        before = stepped[0]
        if case.unscale_first:
            scaler.unscale_(opt)
            if not events:
                inverse = torch.tensor(scale).double().reciprocal().float()  # as torch's unscale_ computes it
                mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                own = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]) * inverse
                run.grads.append((mine, own))
        scaler.step(opt)
        scaler.update()
        run.skipped.append(stepped[0] == before)
        run.scales.append(scaler.get_scale())
    run.params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return run


def agreement_body(backend: dml.Backend, case: AmpCase) -> tuple[tuple[bool, ...], tuple[float, ...], tuple[bool, ...]]:
    """Every rank skips the same steps and keeps the same scale and parameters, those of the unsharded optimizer
    under torch's GradScaler; after unscale_, .grad is unscaled (the reduced values in this rank's shard, its own
    elsewhere). Returns the steps skipped, the scales, and for each step whether this rank's whole .grad was
    finite after backward (where a step was skipped all the same, a check of this rank's .grad alone missed it)."""
    exact = _exact(backend)
    ours = train(backend, case, sharded=True)
    ref = train(backend, case, sharded=False)
    assert ours.skipped == ref.skipped, (ours.skipped, ref.skipped)
    assert ours.scales == ref.scales, (ours.scales, ref.scales)
    assert _same(ours.params, ref.params, exact), (ours.params - ref.params).abs().max()
    every = dml.allgather_object(backend, (ours.skipped, ours.scales, ours.params))
    for skipped, scales, params in every:
        assert (skipped, scales) == (ours.skipped, ours.scales), every
        assert torch.equal(params, ours.params), "the replicas differ"
    for (mine, own), (reduced, _) in zip(ours.grads, ref.grads, strict=True):
        reduced_here = mine == reduced if exact else torch.isclose(mine, reduced, TOLERANCE[0], TOLERANCE[1])
        assert bool((reduced_here | (mine == own)).all()), "a gradient left scaled after unscale_"
    return tuple(ours.skipped), tuple(ours.scales), tuple(ours.finite_here)


def shard_only_body(backend: dml.Backend, overlap: bool) -> tuple[list[bool], list[float], bool]:
    """A sum that overflows in one element (step 1): the rank owning that element sees inf in its shard, the
    others see finite .grad everywhere; every rank skips step 1 alone."""
    case = AmpCase(steps=((), (("reduced", 0, 7),), (), ()), op="avg", overlap=overlap, unscale_first=True)
    skipped, scales, finite_here = agreement_body(backend, case)
    assert list(skipped) == [False, True, False, False], skipped
    every = dml.allgather_object(backend, finite_here[1])
    assert sum(not f for f in every) == 1, every  # only the owner of element 7 saw the inf
    return list(skipped), list(scales), finite_here[1]


def clip_body(backend: dml.Backend, overlap: bool) -> float:
    """unscale_ then opt.clip_grad_norm_ (the sharded optimizer's clipping) then step, against torch's clipping of
    the unsharded gradients (equal up to the norm's rounding); an overflow on one rank skips on every rank."""
    results = []
    for sharded in (True, False):
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = dml.DistributedOptimizer(backend, sgd, overlap=overlap, shard_state=sharded)
        scaler = (dml.ShardedGradScaler if sharded else _torch_scaler)(backend, "cpu", init_scale=INIT_SCALE)
        norms = []
        for s, events in enumerate([(), (("inf", 1, 40),), ()]):
            opt.zero_grad()
            x = _batch(backend.rank, s, 0) * 10
            scaler.scale(_loss(model, x, events, backend, scaler.get_scale())).backward()
            scaler.unscale_(opt)
            params = list(model.parameters())
            norm = opt.clip_grad_norm_(0.5) if sharded else nn.utils.clip_grad_norm_(params, 0.5)
            norms.append(float(norm))
            scaler.step(opt)
            scaler.update()
        results.append((norms, scaler.get_scale(), torch.cat([p.detach().reshape(-1) for p in params])))
    (norms, scale, params), (ref_norms, ref_scale, ref_params) = results
    assert scale == ref_scale == INIT_SCALE * 0.5, (scale, ref_scale)
    assert math.isclose(norms[0], ref_norms[0], rel_tol=1e-6) and norms[0] > 0.5, (norms, ref_norms)
    assert not math.isfinite(norms[1]), norms  # rank 1's inf, on every rank
    torch.testing.assert_close(params, ref_params, rtol=1e-5, atol=1e-6)
    every = dml.allgather_object(backend, (norms, params))
    assert all(n == norms and torch.equal(p, params) for n, p in every), every
    return norms[0]


def _torch_scaler(backend: dml.Backend, device: str, init_scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device, init_scale=init_scale)


def refusal_body(backend: dml.Backend, unscale_first: bool) -> str:
    """torch.amp.GradScaler with the sharded optimizer: scaler.step(opt) raises TypeError on every rank, through
    the public API only (a change in torch's protocol with optimizers fails here rather than passing silently).
    Nothing was stepped, and the same optimizer trains on with dml.ShardedGradScaler."""
    model = make_model()
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    opt.zero_grad()
    scaler.scale(model(_batch(backend.rank, 0, 0)).pow(2).mean()).backward()
    if unscale_first:
        scaler.unscale_(opt)
    try:
        scaler.step(opt)
    except TypeError as e:
        message = str(e)
    else:
        raise AssertionError("torch.amp.GradScaler stepped the sharded optimizer: the refusal is gone")
    assert "torch.amp.GradScaler is not supported" in message and "dml.ShardedGradScaler" in message, message
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), start), "stepped"
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    ours = dml.ShardedGradScaler(backend, "cpu", init_scale=INIT_SCALE)
    ours.scale(model(_batch(backend.rank, 0, 0)).pow(2).mean()).backward()
    ours.step(opt)
    ours.update()
    assert not torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), start), "not stepped"
    every = dml.allgather_object(backend, message)
    assert all(m == message for m in every), every
    return message


def unsharded_body(backend: dml.Backend, overlap: bool) -> list[float]:
    """dml.ShardedGradScaler with the unsharded DistributedOptimizer and with a plain (local) optimizer is torch's
    GradScaler: the same skips, scales and parameters bit for bit; with the plain optimizer, each rank decides for
    itself (rank 1's inf skips rank 1 alone), as torch's does; enabled=False only steps."""
    case = AmpCase(steps=((), (("inf", 1, 40),), (("loss", 0, 0),), (), ()), overlap=overlap)
    runs = []
    for scaler_kind in ("ours", "torch"):
        for wrapped in (True, False):
            model = make_model()
            sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt = dml.DistributedOptimizer(backend, sgd, overlap=overlap) if wrapped else sgd
            scaler = (
                dml.ShardedGradScaler(backend, "cpu", init_scale=INIT_SCALE, growth_interval=2)
                if scaler_kind == "ours"
                else torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
            )
            scales = []
            for s, events in enumerate(case.steps):
                opt.zero_grad()
                scaler.scale(_loss(model, _batch(backend.rank, s, 0), events, backend, scaler.get_scale())).backward()
                if s % 2:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            runs.append((scales, torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    for (scales, params), (ref_scales, ref_params) in zip(runs[:2], runs[2:], strict=True):
        assert scales == ref_scales and torch.equal(params, ref_params), (scales, ref_scales)
    wrapped_scales, plain_scales = runs[0][0], runs[1][0]
    assert wrapped_scales[1] < wrapped_scales[0], wrapped_scales  # the inf reached every rank's averaged .grad
    local_inf = backend.rank == 1 % backend.size
    assert (plain_scales[1] < plain_scales[0]) is local_inf, plain_scales  # each rank its own, as torch's
    model = make_model()
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
    off = dml.ShardedGradScaler(backend, "cpu", enabled=False)
    opt.zero_grad()
    off.scale(model(_batch(backend.rank, 0, 0)).pow(2).mean()).backward()
    off.unscale_(opt)
    off.step(opt)
    off.update()
    assert off.get_scale() == 1.0 and not torch.equal(model[0].weight, make_model()[0].weight)
    return wrapped_scales


def bad_input_body(backend: dml.Backend, culprit: int) -> int:
    """Bad arguments and misuse on rank ``culprit`` only raise there before any communication: a barrier after
    each still pairs with the other ranks' barriers. Each message names the argument or the call."""
    rank = backend.rank
    bad_init: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"backend": "mpi"}, TypeError, "backend instance"),
        ({"device": 0}, TypeError, "device: got int"),
        ({"device": "nowhere"}, ValueError, "device: got 'nowhere'"),
        ({"init_scale": 0.0}, ValueError, "init_scale: got 0.0; allowed: a finite number > 0"),
        ({"init_scale": "big"}, TypeError, "init_scale: got str"),
        ({"init_scale": math.inf}, ValueError, "init_scale"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor: got 1.0; allowed: a finite number > 1"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor: got 1.5; allowed: a number in (0, 1)"),
        ({"growth_interval": 0}, ValueError, "growth_interval: got 0"),
        ({"growth_interval": True}, ValueError, "growth_interval: got True"),
        ({"enabled": 1}, TypeError, "enabled: got 1"),
    ]
    for kwargs, error, fragment in bad_init:
        if rank == culprit:
            arguments = {"backend": backend, "device": "cpu", **kwargs}
            _raises(lambda a=arguments: dml.ShardedGradScaler(**a), error, fragment)
        dml.barrier(backend)

    def setup(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, dml.ShardedGradScaler]:
        model = make_model().to(dtype)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
        return model, opt, dml.ShardedGradScaler(backend, "cpu", init_scale=INIT_SCALE)

    def backward(model: nn.Module, opt: Any, scaler: dml.ShardedGradScaler) -> None:
        opt.zero_grad()
        x = _batch(rank, 0, 0).to(next(model.parameters()).dtype)
        scaler.scale(model(x).pow(2).mean()).backward()

    model, opt, scaler = setup()
    backward(model, opt, scaler)  # every rank: the reduction is done; what follows communicates only if accepted
    if rank == culprit:
        _raises(lambda: scaler.unscale_("opt"), TypeError, "ShardedGradScaler.unscale_: optimizer: got str")
        _raises(lambda: scaler.step(None), TypeError, "ShardedGradScaler.step: optimizer: got NoneType")
        _raises(lambda: scaler.step(opt, lambda: 0.0), RuntimeError, "closure")
        _raises(lambda: scaler.step(opt, closure=lambda: 0.0), RuntimeError, "closure")
        other = dml.LocalBackend() if backend.size > 1 else None
        if other is not None:
            stranger = dml.ShardedGradScaler(other, "cpu")
            _raises(lambda: stranger.unscale_(opt), ValueError, "create the scaler with the optimizer's backend")
        fresh = dml.ShardedGradScaler(backend, "cpu")
        _raises(lambda: fresh.unscale_(opt), AssertionError, "scaler.scale(loss or outputs)")  # torch's own
    dml.barrier(backend)
    scaler.unscale_(opt)  # every rank
    if rank == culprit:
        _raises(lambda: scaler.unscale_(opt), RuntimeError, "unscale_() has already been called")
    dml.barrier(backend)
    scaler.step(opt)  # every rank
    if rank == culprit:
        _raises(lambda: scaler.step(opt), RuntimeError, "step() has already been called")
        _raises(lambda: scaler.unscale_(opt), RuntimeError, "unscale_() is being called after step()")
    dml.barrier(backend)
    scaler.update()
    half, half_opt, half_scaler = setup(torch.float16)
    half_opt.zero_grad()
    half_scaler.scale(half(_batch(rank, 0, 0).half()).float().pow(2).mean()).backward()
    if rank == culprit:
        _raises(lambda: half_scaler.step(half_opt), ValueError, "parameter 0 of group 0 is float16")
    dml.barrier(backend)
    return rank


def _raises(call: Any, error: type[Exception], fragment: str) -> None:
    try:
        call()
    except error as e:
        assert fragment in str(e), f"{fragment!r} not in {e}"
    else:
        raise AssertionError(f"{fragment}: accepted")


def main(names: list[str]) -> None:
    from mpi_main import guarded, hypothesis_check, run_checks

    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)

    def both(body: Any, *cases: Any) -> list[Any]:
        return [guarded(body, world, case) for case in cases]

    checks: dict[str, Any] = {
        "agreement": lambda: hypothesis_check(world, agreement_body, amp_cases(), 20),
        "shard_only": lambda: both(shard_only_body, False, True),
        "clip": lambda: both(clip_body, False, True),
        "refusal": lambda: len(both(refusal_body, False, True)),
        "unsharded": lambda: both(unsharded_body, False, True),
        "bad_input": lambda: both(bad_input_body, *range(world.size)),
    }
    run_checks(world, names or list(checks), "AMP CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
