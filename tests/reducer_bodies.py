"""Bodies of the reduction-during-backward tests, run on LocalBackend.spawn and under mpiexec (tests/reducer_job.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import distutils_ml as dml

from train_bodies import _gen, make_model, replicas_identical


@dataclass(frozen=True)
class GradCase:
    seed: int
    widths: tuple[int, ...]
    bucket_bytes: int
    overlap: bool
    op: str
    dtype: str
    api: str  # "optimizer" or "hooks" (reduce_gradients_in_backward)


@st.composite
def grad_cases(draw: st.DrawFn) -> GradCase:
    return GradCase(
        seed=draw(st.integers(0, 10**6)),
        widths=tuple(draw(st.lists(st.integers(1, 40), min_size=2, max_size=5))),
        bucket_bytes=draw(st.sampled_from([0, 64, 1024, 1 << 20])),
        overlap=draw(st.booleans()),
        op=draw(st.sampled_from(["avg", "sum", "max"])),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        api=draw(st.sampled_from(["optimizer", "hooks"])),
    )


def _mlp(widths: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.nn.Sequential:
    g = _gen(seed)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    return model


def grads_ready_body(backend: dml.Backend, case: GradCase) -> None:
    """When backward() returns, every .grad is already the op over ranks of the local gradients (no step, no
    synchronize); clipping then sees the reduced gradients, and after the step the replicas are identical."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    dtype = getattr(torch, case.dtype)
    g = _gen(case.seed + 7)
    x = torch.randn(size, 3, case.widths[0], generator=g, dtype=dtype)
    model = _mlp(case.widths, case.seed, dtype)
    plain = _mlp(case.widths, case.seed, dtype)  # no hooks: this rank's own gradient
    torch.nn.functional.mse_loss(plain(x[rank]), torch.zeros(3, case.widths[-1], dtype=dtype)).backward()
    local = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).double().numpy()
    every = np.empty((size, local.size))
    dml.allgather(backend, local, every)
    expected = {"avg": every.mean(0), "sum": every.sum(0), "max": every.max(0)}[case.op]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if case.api == "optimizer":
        opt: Any = dml.DistributedOptimizer(
            backend, sgd, op=case.op, bucket_bytes=case.bucket_bytes, overlap=case.overlap
        )
        assert opt.overlap is case.overlap
    else:
        handle = dml.reduce_gradients_in_backward(
            backend, model, case.op, bucket_bytes=case.bucket_bytes, overlap=case.overlap
        )
        assert handle.overlap is case.overlap
        opt = sgd
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank]), torch.zeros(3, case.widths[-1], dtype=dtype)).backward()
        if step == 0:
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=f"rank {rank}: {case}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # on the reduced gradients: the same everywhere
        opt.step()
    if case.api == "hooks":
        handle.remove()
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())


class _Raise(torch.autograd.Function):
    """Identity whose backward raises: a backward interrupted midway."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("interrupted on purpose")


class TwoWay(torch.nn.Module):
    """Two same-shaped layers run in the order ``flip`` says: flipping changes the order gradients are ready."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = _gen(seed)
        self.a = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor, flip: bool = False, interrupt: bool = False) -> torch.Tensor:
        first, second = (self.b, self.a) if flip else (self.a, self.b)
        h = torch.tanh(x @ first)
        if interrupt:
            h = _Raise.apply(h)
        return torch.tanh(h @ second) @ self.c


def errors_body(backend: dml.Backend, overlap: bool) -> list[str]:
    """Errors raised on every rank: ready order differing across ranks, parameters changed behind the
    wrapper (on one rank only), a second backward after one that was interrupted; the world goes on after each."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    x = torch.randn(2, 4, generator=_gen(3), dtype=torch.float64)
    seen = []

    def expect(fn: Any, fragment: str) -> None:
        try:
            fn()
        except RuntimeError as e:
            assert fragment in str(e), f"rank {rank}: {fragment!r} not in {e}"
            seen.append(fragment)
        else:
            raise AssertionError(f"rank {rank}: no RuntimeError with {fragment!r}")

    # 1. The last rank runs the two layers in the other order (same shapes): every rank raises.
    model = TwoWay(0)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=0, overlap=overlap
    )
    model(x).sum().backward()  # the same order everywhere: fine
    opt.step()
    opt.zero_grad()
    if size > 1:
        expect(lambda: model(x, flip=rank == size - 1).sum().backward(), "in a different order on different ranks")
        opt.zero_grad()
    model(x).sum().backward()
    opt.step()

    # 2. A parameter's requires_grad switched on rank 0 only, behind the wrapper: every rank raises.
    opt.zero_grad()
    if rank == 0:
        model.c.requires_grad_(False)
    expect(lambda: model(x).sum().backward(), "the parameters changed after the reduction plan was built")
    model.c.requires_grad_(True)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()

    # 3. A backward interrupted after some buckets went, then another backward: every rank raises, then,
    # after zero_grad(), training goes on.
    opt.zero_grad()
    try:
        model(x, interrupt=True).sum().backward()
    except ValueError:
        pass
    else:
        raise AssertionError("the interrupted backward did not raise")
    expect(lambda: model(x).sum().backward(), "a second backward() started before the gradients")
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    return seen


class _SumAcross(torch.autograd.Function):
    """A user's collective inside backward: the gradient is summed over ranks with dml.allreduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backend: dml.Backend) -> torch.Tensor:
        ctx.backend = backend
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return dml.allreduce(ctx.backend, grad.contiguous().clone(), dml.SUM), None


def collective_in_backward_body(backend: dml.Backend, overlap: bool) -> None:
    """A collective made by the user's code during backward, while buckets are in flight on the communication
    thread, leaves in program order on every rank: results equal the one-process computation."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(11)
    x = torch.randn(size, 2, 6, generator=g, dtype=torch.float64)
    w1 = torch.randn(6, 64, generator=g, dtype=torch.float64)
    w2 = torch.randn(64, 64, generator=g, dtype=torch.float64)
    w3 = torch.randn(64, 3, generator=g, dtype=torch.float64)

    def run(xs: torch.Tensor, summed: bool) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(w.clone()) for w in (w1, w2, w3)]
        h = torch.tanh(xs @ ps[0])
        if summed:
            h = _SumAcross.apply(h, None)
        (torch.tanh(h @ ps[1]) @ ps[2]).sum().backward()
        return ps

    ps = [torch.nn.Parameter(w.clone()) for w in (w1, w2, w3)]
    dml.reduce_gradients_in_backward(backend, ps, bucket_bytes=0, overlap=overlap)
    h = _SumAcross.apply(torch.tanh(x[rank] @ ps[0]), backend)
    (torch.tanh(h @ ps[1]) @ ps[2]).sum().backward()
    # One process: rank r's w1 gradient gets the sum over ranks of the gradients at h; w2, w3 are rank-local.
    refs = [run(x[r], False) for r in range(size)]
    h_grads = []
    for r in range(size):
        hr = torch.tanh(x[r] @ w1).requires_grad_(True)
        (torch.tanh(hr @ w2) @ w3).sum().backward()
        h_grads.append(hr.grad)
    total = sum(h_grads)
    w1_grads = []
    for r in range(size):
        pre = (x[r] @ w1).requires_grad_(True)
        torch.tanh(pre).backward(total)
        w1_grads.append(x[r].T @ pre.grad)
    expected = [sum(w1_grads) / size] + [sum(ref[k].grad for ref in refs) / size for k in (1, 2)]
    for p, e in zip(ps, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)


def buffers_body(backend: dml.Backend, overlap: bool) -> None:
    """broadcast_buffers with reduction during backward: every forward starts from rank 0's BatchNorm running
    statistics, gradients are averaged, and the result equals a one-process simulation of DDP's rule."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(5)
    steps = 3
    x = torch.randn(steps, size, 4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(steps, size, 4, 2, generator=g, dtype=torch.float64)
    model = make_model(9, bn=True).double()
    with torch.no_grad():  # different buffers on every rank: rank 0's must win
        for b in model.buffers():
            if b.dtype.is_floating_point:
                b.add_(rank)
    dml.synchronize(backend, list(model.parameters()))
    handle = dml.broadcast_buffers(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap)
    # The simulation: replicas start from rank 0's state; before each forward every replica takes replica 0's
    # buffers; gradients are averaged.
    replicas = [make_model(9, bn=True).double() for _ in range(size)]
    for rep in replicas:
        rep.load_state_dict(replicas[0].state_dict())
    for k in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[k, rank]), y[k, rank]).backward()
        opt.step()
        first = {n: b.clone() for n, b in replicas[0].named_buffers()}
        grads = []
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for n, b in rep.named_buffers():
                    b.copy_(first[n])
            rep.zero_grad()
            torch.nn.functional.mse_loss(rep(x[k, r]), y[k, r]).backward()
            grads.append([p.grad.clone() for p in rep.parameters()])
        with torch.no_grad():
            for rep in replicas:
                for j, p in enumerate(rep.parameters()):
                    p.sub_(0.1 * sum(gr[j] for gr in grads) / size)
    handle.remove()
    for p, q in zip(model.parameters(), replicas[rank].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    for (n, b), q in zip(model.named_buffers(), replicas[rank].buffers(), strict=True):
        torch.testing.assert_close(b, q, rtol=1e-10, atol=1e-12, msg=n)
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())


TWO_OPTIMIZER_CASES = ("unused_first", "unused_second", "order")


def two_optimizers_body(backend: dml.Backend, overlap: bool, shard: bool, how: str) -> list[Any]:
    """Two optimizers on one backend whose reductions the last rank reaches in another order (``how``: the first's
    layer unused there, or the second's, or the loss terms the other way round): every rank gets the gradients
    of one process on all the ranks' batches, or every rank raises; never another optimizer's gradients. Returns
    what each case gave here (the gradients, or the error's class); the world goes on after each."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = torch.Generator().manual_seed(5)
    layers = [torch.nn.Linear(3, 2).double() for _ in range(2)]
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    opts = [
        dml.DistributedOptimizer(
            backend, torch.optim.SGD(layer.parameters(), lr=0.1), overlap=overlap, shard_state=shard
        )
        for layer in layers
    ]
    x = [torch.randn(2, 3, generator=_gen(10 + r), dtype=torch.float64) * (r + 1) for r in range(size)]
    last = size - 1

    def terms(r: int) -> list[int]:
        """The layers rank ``r``'s loss uses, in the order it adds them."""
        if r != last:
            return [0, 1]
        return {"unused_first": [1], "unused_second": [0], "order": [1, 0]}[how]

    sum(layers[k](x[rank]).sum() for k in (0, 1)).backward()  # a first round alike everywhere: the plans are built
    for opt in opts:
        opt.step()
        opt.zero_grad()
    expected = []
    for k, layer in enumerate(layers):  # one process: the mean over ranks of each rank's own gradient
        want = torch.zeros_like(layer.weight)
        for r in range(size):
            if k in terms(r):
                w = layer.weight.detach().clone().requires_grad_(True)
                (torch.nn.functional.linear(x[r], w, layer.bias.detach()).pow(2).sum()).backward()
                want += w.grad
        expected.append(want / size)
    try:
        sum(layers[k](x[rank]).pow(2).sum() for k in terms(rank)).backward()
        for opt in opts:
            opt.synchronize()  # what the step reads; with shard_state=True the whole gradient is not kept
        got = [None if layer.weight.grad is None else layer.weight.grad.clone() for layer in layers]
    except RuntimeError as e:
        assert "paired, on some rank, with the reduction of another optimizer" in str(e), e
        outcome: list[Any] = ["RuntimeError"]
    else:
        if not shard:
            for k in range(2):
                assert got[k] is not None and torch.allclose(got[k], expected[k], rtol=1e-12, atol=1e-12), (
                    how,
                    k,
                    got[k],
                    expected[k],
                )
        outcome = ["reduced"]
    for opt in opts:
        opt.zero_grad()
    check = torch.full((1,), float(rank))
    dml.allreduce(backend, check, dml.SUM)  # the world goes on: nothing of the case is left in flight
    assert check.item() == size * (size - 1) / 2, check
    return outcome
