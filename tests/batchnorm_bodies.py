"""Bodies of the SyncBatchNorm tests: each takes the backend (and a case) and asserts, on every rank.

The same bodies run on ``LocalBackend.spawn`` (tests/test_batchnorm.py) and under real
``mpiexec`` (tests/batchnorm_job.py), on CPU tensors and, where there is a GPU, on CUDA
ones (``device``). Every rank rebuilds every rank's data from the case, so each rank
also computes the one-process reference: ``torch.nn.BatchNorm`` on the concatenation
of the ranks' batches, with the sum of the ranks' losses.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import nn

import distutils_ml as dml

MOMENTA = (None, 0.1, 0.7)


# -- helpers ------------------------------------------------------------------------------------


def world_usable(backend: dml.Backend) -> None:
    """A good collective right after: no rank was left behind or has stale data queued."""
    total = np.ones(2)
    dml.allreduce(backend, total, dml.SUM)
    assert (total == backend.size).all(), total


def raised(fn: Callable[[], Any]) -> tuple[type[BaseException] | None, str]:
    """(exception class, message) of ``fn()``, or (None, "no error")."""
    try:
        fn()
    except Exception as e:
        return type(e), str(e)
    return None, "no error"


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``got`` equals ``want`` up to ``tol`` relative to ``want``'s largest magnitude (bitwise when tol is 0)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if tol == 0:
        assert torch.equal(got, want), (what, got, want)
        return
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = 1.0 + (want.double().abs().max().item() if want.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} * {scale:.3g}\n{got}\n{want}"


def summed(backend: dml.Backend, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The sum over ranks of a parameter's gradient (None stays None: it is None on every rank)."""
    return None if grad is None else dml.allreduce(backend, grad.detach().clone(), dml.SUM)


def seeded(module: nn.Module, seed: int) -> nn.Module:
    """``module`` with parameters drawn from ``seed`` (not the global RNG, which simulated ranks share)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def torch_batchnorm(ndim: int) -> type[nn.modules.batchnorm._BatchNorm]:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]


# -- the property: forward, gradients, running statistics, eval ---------------------------------------------


@dataclass(frozen=True)
class Case:
    """One drawn layer and its batches: per-rank batch sizes, the shape after them, the layer's settings."""

    sizes: tuple[int, ...]  # this case's batch size on each rank (0 allowed)
    channels: int
    spatial: tuple[int, ...]  # (), (L,), (H, W) or (D, H, W)
    dtype: str  # "float32" (values on a grid, exact statistics) or "float64" (continuous values)
    affine: bool
    momentum: float | None
    track: bool  # track_running_stats
    steps: int
    seed: int

    @property
    def tol(self) -> float:
        return 1e-4 if self.dtype == "float32" else 1e-10


@st.composite
def cases(draw: st.DrawFn, world: int) -> Case:
    """A random case for ``world`` ranks whose global batch has at least 2 values per channel."""
    ndim = draw(st.sampled_from([2, 2, 3, 4, 4, 5]))
    spatial = tuple(draw(st.integers(1, 3)) for _ in range(ndim - 2))
    sizes = draw(st.lists(st.integers(0, 4), min_size=world, max_size=world))
    if sum(sizes) * math.prod(spatial) < 2:
        sizes[draw(st.integers(0, world - 1))] = 2
    return Case(
        sizes=tuple(sizes),
        channels=draw(st.integers(1, 5)),
        spatial=spatial,
        dtype=draw(st.sampled_from(["float32", "float64"])),
        affine=draw(st.booleans()),
        momentum=draw(st.sampled_from(MOMENTA)),
        track=draw(st.booleans()),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def values(case: Case, shape: tuple[int, ...], *key: int) -> torch.Tensor:
    """Deterministic data for ``key`` (the same on every rank): a grid of quarters, or normal with an offset."""
    g = torch.Generator().manual_seed(hash((case.seed, *key)) % 2**63)
    if case.dtype == "float32":
        return torch.randint(-8, 9, shape, generator=g).float() / 4
    return torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1


def layers(case: Case, backend: dml.Backend, device: str) -> tuple[dml.SyncBatchNorm, nn.Module]:
    """The layer under test on ``device`` and its reference (CPU), with the same affine parameters."""
    dtype = getattr(torch, case.dtype)
    settings = dict(momentum=case.momentum, affine=case.affine, track_running_stats=case.track, dtype=dtype)
    ours = dml.SyncBatchNorm(backend, case.channels, device=device, **settings)
    ref = torch_batchnorm(2 + len(case.spatial))(case.channels, **settings)
    if case.affine:
        with torch.no_grad():
            for p, q, k in ((ours.weight, ref.weight, 1), (ours.bias, ref.bias, 2)):
                v = values(case, (case.channels,), -1, k)
                p.copy_(v)
                q.copy_(v)
    return ours, ref


def batchnorm_body(backend: dml.Backend, case: Case, device: str = "cpu") -> None:
    """dml.SyncBatchNorm on this rank's batch equals torch.nn.BatchNorm on the concatenated batch.

    Each training step compares this rank's output and input gradient with its slice of
    the reference's, the parameter gradients summed over the ranks with the reference's
    (the loss is the sum of the ranks' losses), and the running statistics. Then eval:
    with running statistics, ranks run different numbers of forwards (plain BatchNorm:
    no communication); without, the global batch statistics again. In a world of one
    on CPU every comparison is bitwise.
    """
    rank, world = backend.rank, backend.size
    assert len(case.sizes) == world, (case, world)
    tol = 0 if world == 1 and device == "cpu" else case.tol
    ours, ref = layers(case, backend, device)
    start = sum(case.sizes[:rank])
    mine = slice(start, start + case.sizes[rank])
    shape = lambda n: (n, case.channels, *case.spatial)  # noqa: E731

    for step in range(case.steps):
        xs = [values(case, shape(n), step, r) for r, n in enumerate(case.sizes)]
        ups = [values(case, shape(n), step, r, 7) for r, n in enumerate(case.sizes)]
        x = xs[rank].to(device, copy=True).requires_grad_()
        ours.zero_grad()
        y = ours(x)
        (y * ups[rank].to(device)).sum().backward()
        big = torch.cat(xs).requires_grad_()
        ref.zero_grad()
        want = ref(big)
        (want * torch.cat(ups)).sum().backward()

        close(y, want[mine], tol, f"step {step}: output")
        close(x.grad, big.grad[mine], tol, f"step {step}: input gradient")
        for name in ("weight", "bias"):
            got = summed(backend, getattr(ours, name).grad if case.affine else None)
            if case.affine:
                close(got, getattr(ref, name).grad, tol, f"step {step}: {name} gradient summed over ranks")
        for name in ("running_mean", "running_var"):
            if case.track:
                close(getattr(ours, name), getattr(ref, name), tol, f"step {step}: {name}")
            else:
                assert getattr(ours, name) is None
        if case.track:
            assert ours.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1

    ours.eval()
    ref.eval()
    if case.track:  # running statistics: no communication, so the ranks may run different numbers of forwards
        for k in range(rank + 1):
            x = values(case, shape(3), 99, rank, k)
            with torch.no_grad():
                close(ours(x.to(device)), ref(x), tol, f"eval forward {k}")
    else:  # batch statistics of the global batch, in eval mode too
        xs = [values(case, shape(n), 99, r) for r, n in enumerate(case.sizes)]
        close(ours(xs[rank].to(device)), ref(torch.cat(xs))[mine], tol, "eval forward without running statistics")
    world_usable(backend)


def half_body(backend: dml.Backend, device: str = "cpu") -> None:
    """bfloat16 input: statistics in float32, a bfloat16 output close to BatchNorm's on the global batch."""
    rank, world = backend.rank, backend.size
    xs = [torch.randn(4 + r, 3, 5, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(world)]
    ours = dml.SyncBatchNorm(backend, 3, device=device)
    ref = nn.BatchNorm1d(3)
    y = ours(xs[rank].to(device))
    want = ref(torch.cat([x.float() for x in xs]))
    assert y.dtype == torch.bfloat16
    start = sum(4 + r for r in range(rank))
    close(y.float(), want[start : start + 4 + rank], 2e-2, "bfloat16 output")
    close(ours.running_var, ref.running_var, 1e-5, "running_var from bfloat16 input")


# -- channel means far from zero next to the spread ------------------------------------------------------

SLACK = 16  # each bound of shifted_body is this many times its estimate (the worst in 2000 drawn cases: 4 times)
OFFSETS = (0.0, 1e2, 1e3, 3e3, 1e4, -1e2, -1e3, -3e3, -1e4)
MAX_RATIO = 1e4  # |offset| / scale: float32 still holds the spread next to the offset to about 1e-3


@dataclass(frozen=True)
class Shifted:
    """Batches of ``offset + scale * (randn + rank)``: a channel mean far from zero next to the spread."""

    sizes: tuple[int, ...]  # this case's batch size on each rank (0 allowed)
    channels: int
    spatial: tuple[int, ...]  # (), (L,) or (H, W)
    offset: float
    scale: float
    dtype: str  # "float32" or "float64"
    affine: bool
    momentum: float | None
    steps: int
    seed: int


@st.composite
def shifted_cases(draw: st.DrawFn, world: int) -> Shifted:
    """A random case for ``world`` ranks with offsets up to 1e4 and scales from 1e-3 to 1e2."""
    ndim = draw(st.sampled_from([2, 3, 4]))
    spatial = tuple(draw(st.integers(1, 3)) for _ in range(ndim - 2))
    sizes = draw(st.lists(st.integers(0, 5), min_size=world, max_size=world))
    if sum(sizes) * math.prod(spatial) < 2:
        sizes[draw(st.integers(0, world - 1))] = 2
    offset = draw(st.sampled_from(OFFSETS) | st.floats(-1e4, 1e4))
    lowest = max(-3.0, math.log10(abs(offset) / MAX_RATIO)) if abs(offset) > 1 else -3.0
    return Shifted(
        sizes=tuple(sizes),
        channels=draw(st.integers(1, 3)),
        spatial=spatial,
        offset=offset,
        scale=10 ** draw(st.floats(lowest, 2.0)),
        dtype=draw(st.sampled_from(["float32", "float32", "float64"])),
        affine=draw(st.booleans()),
        momentum=draw(st.sampled_from(MOMENTA)),
        steps=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def normal(seed: int, shape: tuple[int, ...], *key: int) -> torch.Tensor:
    """Standard normal float64 values for ``key`` (the same on every rank)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(hash((seed, *key)) % 2**63), dtype=torch.float64)


def near(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    """``got`` is within ``SLACK * bound`` of the float64 reference ``want``, everywhere."""
    err = (got.detach().cpu().double() - want.detach()).abs().max().item() if want.numel() else 0.0
    assert err <= SLACK * bound, f"{what}: max error {err:.3g} > {SLACK} * {bound:.3g}"


def shifted_body(backend: dml.Backend, case: Shifted, device: str = "cpu") -> None:
    """Large channel means: outputs, gradients and running statistics as accurate as the dtype allows.

    The reference is ``torch.nn.BatchNorm`` in float64 on the concatenated batch (of the same
    values). Normalizing ``x`` has the condition number ``1 + max|x| / std``: rounding the
    mean to the dtype alone moves ``x - mean`` by a unit roundoff of ``max|x|``. Each bound
    is the unit roundoff times that condition number times the quantity's natural size;
    statistics from sums of ``x`` and ``x * x`` err by its square instead (10^4 times
    more at an offset of 10^4 standard deviations). The ranks' means differ by a few
    ``scale``, so the combination across ranks counts too.
    """
    rank = backend.rank
    dtype = getattr(torch, case.dtype)
    unit = torch.finfo(dtype).eps / 2
    ours = dml.SyncBatchNorm(
        backend, case.channels, momentum=case.momentum, affine=case.affine, device=device, dtype=dtype
    )
    ref = torch_batchnorm(2 + len(case.spatial))(
        case.channels, momentum=case.momentum, affine=case.affine, dtype=torch.float64
    )
    size = 1.0  # max |weight| + max |bias|: the output's scale
    if case.affine:
        with torch.no_grad():
            for p, q, k in ((ours.weight, ref.weight, 1), (ours.bias, ref.bias, 2)):
                v = normal(case.seed, (case.channels,), -1, k).to(dtype)
                p.copy_(v)
                q.copy_(v)
        size = ref.weight.abs().max().item() + ref.bias.abs().max().item()
    start = sum(case.sizes[:rank])
    mine = slice(start, start + case.sizes[rank])
    shape = lambda n: (n, case.channels, *case.spatial)  # noqa: E731
    dims = [0, *range(2, 2 + len(case.spatial))]
    worst, reach = 1.0, 1.0  # over the steps so far: the condition number, the largest |x| + 1

    for step in range(case.steps):
        xs = [
            (case.offset + case.scale * (normal(case.seed, shape(n), step, r) + r)).to(dtype)
            for r, n in enumerate(case.sizes)
        ]
        ups = [normal(case.seed, shape(n), step, r, 7).to(dtype) for r, n in enumerate(case.sizes)]
        x = xs[rank].to(device, copy=True).requires_grad_()
        ours.zero_grad()
        y = ours(x)
        (y * ups[rank].to(device)).sum().backward()
        big = torch.cat(xs).double().requires_grad_()
        up = torch.cat(ups).double()
        ref.zero_grad()
        want = ref(big)
        (want * up).sum().backward()

        var = big.detach().var(dims, unbiased=False)
        cond = 1 + (big.detach().abs().amax(dims) / var.sqrt()).max().item()
        worst, reach = max(worst, cond), max(reach, 1 + big.detach().abs().max().item())
        scaled = (ref.weight.detach().abs() if case.affine else 1) / (var + ours.eps).sqrt()
        mass = up.abs().sum(dims).max().item()  # the largest sum of |dy| over a channel

        near(y, want[mine], unit * cond * (1 + size), f"step {step}: output")
        near(x.grad, big.grad[mine], unit * cond * scaled.max().item() * up.abs().max().item(), f"step {step}: dx")
        if case.affine:
            for name in ("weight", "bias"):
                got = summed(backend, getattr(ours, name).grad)
                near(got, getattr(ref, name).grad, unit * cond * mass, f"step {step}: {name} gradient over ranks")
        near(ours.running_mean, ref.running_mean, unit * reach, f"step {step}: running_mean")
        near(
            ours.running_var,
            ref.running_var,
            unit * worst * (1 + ref.running_var.max().item()),
            f"step {step}: running_var",
        )
    world_usable(backend)


def second_order_body(backend: dml.Backend, device: str = "cpu") -> None:
    """A gradient penalty (a double backward) through the layer equals BatchNorm's on the global batch."""
    rank, world = backend.rank, backend.size
    xs = [normal(r, (3 + r, 2, 4), 0) * 2 + 5 for r in range(world)]
    us = [normal(r, (3 + r, 2, 4), 1) for r in range(world)]
    vs = [normal(r, (3 + r, 2, 4), 2) for r in range(world)]
    ours = dml.SyncBatchNorm(backend, 2, device=device, dtype=torch.float64)
    ref = nn.BatchNorm1d(2, dtype=torch.float64)
    with torch.no_grad():
        for p, q in ((ours.weight, ref.weight), (ours.bias, ref.bias)):
            p.copy_(torch.tensor([1.5, -0.5]))
            q.copy_(p)
    start = sum(3 + r for r in range(rank))
    mine = slice(start, start + 3 + rank)

    x = xs[rank].to(device, copy=True).requires_grad_()
    (gx,) = torch.autograd.grad((ours(x) * us[rank].to(device)).sum(), x, create_graph=True)
    (gx * vs[rank].to(device)).sum().backward()
    big = torch.cat(xs).requires_grad_()
    (g,) = torch.autograd.grad((ref(big) * torch.cat(us)).sum(), big, create_graph=True)
    (g * torch.cat(vs)).sum().backward()

    close(gx, g[mine], 1e-10, "first derivative")
    close(x.grad, big.grad[mine], 1e-10, "second derivative: input")
    close(summed(backend, ours.weight.grad), ref.weight.grad, 1e-10, "second derivative: weight, over ranks")
    world_usable(backend)


# -- allreduce_autograd -----------------------------------------------------------------------------------


def allreduce_autograd_body(backend: dml.Backend, device: str = "cpu") -> None:
    """Forward: the reduction; backward: the same reduction of the ranks' gradients, to second order."""
    rank, world = backend.rank, backend.size
    coef = [torch.tensor([r + 1.0, 2.0 - r], dtype=torch.float64) for r in range(world)]
    xs = [torch.tensor([r + 1.0, 3.0 * r], dtype=torch.float64) for r in range(world)]
    for op, scale in ((dml.SUM, 1.0), ("avg", 1.0 / world), (dml.AVG, 1.0 / world)):
        x = xs[rank].to(device, copy=True).requires_grad_()
        before = x.detach().clone()
        y = dml.allreduce_autograd(backend, x, op)
        assert y.device == x.device and torch.equal(x.detach(), before), "the input is not modified"
        close(y, sum(xs) * scale, 1e-12, f"{op}: forward")
        (y * coef[rank].to(device)).sum().backward()
        close(x.grad, sum(coef) * scale, 1e-12, f"{op}: gradient")
    # Second order, with y = sum_s x_s and the losses c_r . y^2: their gradient g = 2 (sum c) y on every rank;
    # then the losses d_r . g: their gradient is 2 (sum c)(sum d).
    x = xs[rank].to(device, copy=True).requires_grad_()
    y = dml.allreduce_autograd(backend, x, dml.SUM)
    (g,) = torch.autograd.grad((coef[rank].to(device) * y * y).sum(), x, create_graph=True)
    close(g, 2 * sum(xs) * sum(coef), 1e-12, "first derivative")
    d = [torch.tensor([1.0, r - 0.5], dtype=torch.float64) for r in range(world)]
    (g * d[rank].to(device)).sum().backward()
    close(x.grad, 2 * sum(coef) * sum(d), 1e-12, "second derivative")
    world_usable(backend)


def allreduce_autograd_errors_body(backend: dml.Backend) -> None:
    """Bad op, tensor or backend: the error on every rank, before any communication."""
    x = torch.ones(2, requires_grad=True)
    for op in (dml.MAX, "min", dml.PROD, max):
        kind, msg = raised(lambda op=op: dml.allreduce_autograd(backend, x, op))
        assert kind is ValueError and "allowed: dml.SUM or dml.AVG" in msg, (kind, msg)
    kind, msg = raised(lambda: dml.allreduce_autograd(backend, x, "bogus"))
    assert kind is ValueError and "op: got 'bogus'" in msg, (kind, msg)
    kind, msg = raised(lambda: dml.allreduce_autograd(backend, np.ones(2)))
    assert kind is TypeError and "numpy.ndarray" in msg and "dml.allreduce" in msg, (kind, msg)
    kind, msg = raised(lambda: dml.allreduce_autograd(type(backend), x))
    assert kind is TypeError and "must be a backend instance" in msg, (kind, msg)
    world_usable(backend)


# -- errors of SyncBatchNorm --------------------------------------------------------------------------------


def too_few_values_body(backend: dml.Backend) -> None:
    """One value per channel over all ranks raises on every rank, as torch does; none at all is torch's empty batch."""
    rank = backend.rank
    bn = dml.SyncBatchNorm(backend, 3)
    with torch.no_grad():
        bn.running_mean.fill_(0.5)
    x = torch.ones(1 if rank == 0 else 0, 3)
    kind, msg = raised(lambda: bn(x))
    assert kind is ValueError and "Expected more than 1 value per channel when training" in msg, (kind, msg)
    assert (bn.running_mean == 0.5).all() and (bn.running_var == 1).all()
    assert bn.num_batches_tracked.item() == 1  # counted before the check, as torch.nn.BatchNorm does

    empty = torch.zeros(0, 3, 2, requires_grad=True)
    y = bn(empty)
    y.sum().backward()
    assert y.shape == (0, 3, 2) and empty.grad.shape == (0, 3, 2)
    assert (bn.running_mean == 0.5).all() and (bn.running_var == 1).all() and bn.num_batches_tracked.item() == 2
    assert torch.equal(bn.weight.grad, torch.zeros(3)) and torch.equal(bn.bias.grad, torch.zeros(3))
    world_usable(backend)


# Each misuse: how the culprit rank calls the layer, and the exception class it raises alone.
MISUSES: dict[str, tuple[Callable[[nn.Module], Any], type[Exception], str]] = {
    "channels": (lambda bn: bn(torch.ones(4, 5)), ValueError, "has 5 channels (dimension 1)"),
    "dims": (lambda bn: bn(torch.ones(4)), ValueError, "expected at least 2D input (got 1D input)"),
    "dtype": (lambda bn: bn(torch.ones(4, 3, dtype=torch.int64)), TypeError, "allowed: a floating-point tensor"),
    "type": (lambda bn: bn([[1.0, 2.0, 3.0]] * 4), TypeError, "allowed: a torch.Tensor"),
}


def bad_input_body(backend: dml.Backend, misuse: str, culprit: int, stateless: bool = False) -> None:
    """One rank's bad input makes every rank raise, naming that rank; state unchanged; the world still works.
    ``stateless``: a layer without parameters or buffers (affine=False, track_running_stats=False)."""
    rank, world = backend.rank, backend.size
    call, cls, text = MISUSES[misuse]
    options: dict[str, Any] = {"affine": False, "track_running_stats": False} if stateless else {}
    bn = dml.SyncBatchNorm(backend, 3, **options)
    x = torch.arange(12.0).reshape(4, 3)
    kind, msg = raised(lambda: call(bn) if rank == culprit else bn(x))
    tracked = 0
    if world == 1:  # torch.nn.BatchNorm's own behaviour
        plain = nn.BatchNorm1d(3, **options)
        assert kind is raised(lambda: call(plain))[0], msg  # stateless torch takes any channel count
        assert kind is not None or (stateless and misuse == "channels"), msg
        tracked = 0 if stateless else plain.num_batches_tracked.item()  # torch counts the batch before some checks
    else:
        assert kind is cls, (kind, msg)
        assert f"rank(s) [{culprit}] cannot normalize their input" in msg and text in msg, msg
    if not stateless:
        assert bn.num_batches_tracked.item() == tracked
        assert (bn.running_mean == 0).all() and (bn.running_var == 1).all()
    y = bn(x)  # the next forward works on every rank
    assert y.shape == x.shape
    if not stateless:
        assert bn.num_batches_tracked.item() == tracked + 1
    world_usable(backend)


def constructor_errors_body(backend: dml.Backend) -> None:
    """Not a backend, not a module: TypeError before any communication."""
    for fn, text in (
        (lambda: dml.SyncBatchNorm(dml.LocalBackend, 3), "SyncBatchNorm: the first argument must be a backend"),
        (lambda: dml.convert_sync_batchnorm(None, nn.BatchNorm1d(3)), "convert_sync_batchnorm: the first argument"),
        (lambda: dml.convert_sync_batchnorm(backend, [nn.BatchNorm1d(3)]), "module: got builtins.list"),
    ):
        kind, msg = raised(fn)
        assert kind is TypeError and text in msg, (kind, msg)
    world_usable(backend)


# -- convert_sync_batchnorm ------------------------------------------------------------------------------


class Net(nn.Module):
    """BatchNorm layers at several depths: in a Sequential inside the module, in the head, and at the top."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
        self.extra = nn.SyncBatchNorm(4, eps=1e-3, momentum=None)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16, 3), nn.BatchNorm1d(3, momentum=0.3, affine=False))
        self.tail = nn.BatchNorm1d(3, track_running_stats=False)
        self.tail.bias = None  # an affine layer without a bias (torch's BatchNorm(bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(self.extra(self.features(x))))


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def convert_body(backend: dml.Backend) -> None:
    """Every BatchNorm becomes a dml.SyncBatchNorm holding the same Parameters, buffers and settings."""
    rank, world = backend.rank, backend.size
    model = seeded(Net(), 0)
    model.extra.eval()
    model.features[1].qconfig = "marker"
    before = _norms(model)
    params = list(model.parameters())
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    out = dml.convert_sync_batchnorm(backend, model)
    assert out is model
    after = _norms(model)
    assert list(after) == list(before) == ["features.1", "extra", "head.2", "tail"]
    for name, old in before.items():
        new = after[name]
        assert type(new) is dml.SyncBatchNorm and new.backend is backend, name
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            assert getattr(new, attr) == getattr(old, attr), (name, attr)
        for attr in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(new, attr) is getattr(old, attr), (name, attr)
    assert after["features.1"].qconfig == "marker"
    assert after["tail"].weight is not None and after["tail"].bias is None
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True)), "the same Parameters, in order"
    assert all(v is tensors[k] for k, v in model.state_dict(keep_vars=True).items())
    assert list(model.state_dict()) == list(tensors)

    # Converting again over the same backend keeps the layers; a BatchNorm at the root becomes a new layer.
    assert dml.convert_sync_batchnorm(backend, model) is model and _norms(model) == after
    root = nn.BatchNorm3d(2)
    converted = dml.convert_sync_batchnorm(backend, root)
    assert type(converted) is dml.SyncBatchNorm and converted.weight is root.weight

    # The converted model synchronizes: after a training step on different data every rank holds the same
    # running statistics, and the optimizer made before the conversion steps the same Parameters.
    x = torch.randn(2 + rank, 3, 2, 2, generator=torch.Generator().manual_seed(rank))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    mine = torch.cat([t.reshape(-1) for k, t in model.state_dict().items() if "running" in k])
    every = dml.allgather_object(backend, mine)
    assert all(torch.equal(t, every[0]) for t in every), every
    assert model.features[1].num_batches_tracked.item() == 1 and model.extra.num_batches_tracked.item() == 0
    assert len(every) == world
    world_usable(backend)


# -- synchronize, broadcast_buffers, copies ------------------------------------------------------------------


def sync_and_buffers_body(backend: dml.Backend) -> None:
    """dml.SyncBatchNorm is not refused: synchronize and broadcast_buffers move its buffers like BatchNorm's."""
    rank, root = backend.rank, backend.size - 1
    model = nn.Sequential(nn.Linear(3, 4), dml.SyncBatchNorm(backend, 4))
    with torch.no_grad():
        model[1].running_mean.fill_(rank)
        model[1].weight.fill_(rank + 1)
        model[1].num_batches_tracked.fill_(rank)
    assert dml.synchronize(backend, model, root=root) is model
    assert (model[1].running_mean == root).all() and (model[1].weight == root + 1).all()
    assert model[1].num_batches_tracked.item() == root

    with torch.no_grad():
        model[1].running_var.fill_(rank + 2)
    handle = dml.broadcast_buffers(backend, model, root=root)
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 3))  # the first forward: root's buffers everywhere first
    handle.remove()
    assert (model[1].running_var == root + 2).all(), model[1].running_var
    world_usable(backend)


def copy_body(backend: dml.Backend) -> None:
    """deepcopy shares the backend and copies the rest; pickling is a clear TypeError; state_dict is BatchNorm's."""
    rank = backend.rank
    model = nn.Sequential(nn.Linear(3, 4), dml.SyncBatchNorm(backend, 4))
    twin = copy.deepcopy(model)
    assert twin[1].backend is backend and twin[1].weight is not model[1].weight
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), model.state_dict().values(), strict=True))
    twin(torch.randn(2 + rank, 3))  # the copy synchronizes too
    every = dml.allgather_object(backend, twin[1].running_mean)
    assert all(torch.equal(t, every[0]) for t in every)
    assert (model[1].running_mean == 0).all(), "the original is untouched"
    for fn in (lambda: pickle.dumps(model), lambda: torch.save(model, io.BytesIO()), lambda: copy.copy(model[1])):
        kind, msg = raised(fn)
        assert kind is TypeError and "cannot be pickled" in msg and "state_dict()" in msg, (kind, msg)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plain.load_state_dict(twin.state_dict())
    assert torch.equal(plain[1].running_mean, twin[1].running_mean)
    world_usable(backend)


# -- training with DistributedOptimizer ------------------------------------------------------------------


def _small_net(seed: int) -> nn.Module:
    return seeded(nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 1)), seed)


def training_body(backend: dml.Backend) -> None:
    """A converted model trained with DistributedOptimizer (AVG) equals one process on the global batch.

    The ranks hold batches of different sizes; the one-process loss is the mean over the
    ranks of their losses, which is what averaging the ranks' gradients optimizes.
    """
    rank, world = backend.rank, backend.size
    model = dml.convert_sync_batchnorm(backend, _small_net(0))
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref = _small_net(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        xs = [torch.randn(2 + r, 2, 6, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]
        opt.zero_grad()
        model(xs[rank]).pow(2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (ref(torch.cat(xs)).pow(2).sum() / world).backward()
        ref_opt.step()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        close(got, want, 1e-5, name)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = dml.allgather_object(backend, flat)
    assert all(torch.equal(t, every[0]) for t in every), "replicas differ"
    world_usable(backend)


# The bodies that take only the backend, run on every world size.
BODIES: list[Callable[[dml.Backend], None]] = [
    half_body,
    second_order_body,
    allreduce_autograd_body,
    allreduce_autograd_errors_body,
    too_few_values_body,
    constructor_errors_body,
    convert_body,
    sync_and_buffers_body,
    copy_body,
    training_body,
]


def mixed_dtype_body(backend: dml.Backend, culprit: int, stateless: bool) -> None:
    """Inputs whose dtype the layer does not take, as torch.nn.BatchNorm does not: a float64 batch into float32
    parameters (on one rank, or on every rank) raises TypeError on every rank before the statistics travel (the
    rows went in the input's dtype: mismatched collectives); a layer without parameters or buffers takes any
    floating dtype, alike on every rank (different ones raise on every rank), and float64 on every rank is
    torch's BatchNorm on the concatenated batch."""
    rank, world = backend.rank, backend.size
    options: dict[str, Any] = {"affine": False, "track_running_stats": False} if stateless else {}
    bn = dml.SyncBatchNorm(backend, 3, **options)
    x = torch.arange(12.0).reshape(4, 3) * (rank + 1)
    odd = x.double() if rank == culprit else x
    kind, msg = raised(lambda: bn(odd))
    assert kind is TypeError, (kind, msg)
    if stateless:
        assert "inputs give statistics of different dtypes" in msg and f"rank {culprit}: float64" in msg, msg
    else:
        assert f"rank(s) [{culprit}] cannot normalize their input" in msg and "are torch.float32" in msg, msg
        assert bn.num_batches_tracked.item() == 0 and (bn.running_mean == 0).all()
        kind, msg = raised(lambda: bn(x.double()))  # every rank
        assert kind is TypeError and f"rank(s) {list(range(world))} cannot normalize" in msg, (kind, msg)
    for half in (torch.float16, torch.bfloat16):  # with float32 parameters, as torch takes them
        assert bn(x.to(half)).dtype == half
    if stateless:
        y = bn(x.double())
        every = torch.cat([torch.arange(12.0).reshape(4, 3) * (r + 1) for r in range(world)]).double()
        want = nn.BatchNorm1d(3, **options).double()(every)[4 * rank : 4 * rank + 4]
        close(y, want, 1e-12, "float64 on every rank")
    world_usable(backend)
