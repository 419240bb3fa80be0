"""Bodies for what DDP users do (issue 22): double backward, gradient penalties, activation checkpointing.

Each body runs on every rank, on ``LocalBackend.spawn`` (tests/test_buckets.py) and under mpiexec
(tests/habits_job.py), and compares with a reference every rank computes alone: one process on the whole
batch, or the same model without checkpointing. Models are built from explicit generators (threads of
simulated ranks share torch's global generator).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import distutils_ml as dml

FORMS = ("plain", "sharded")


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


def _wrap(
    backend: dml.Backend, model: torch.nn.Module, form: str, overlap: bool, **options
) -> dml.DistributedOptimizer:
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return dml.DistributedOptimizer(backend, inner, shard_state=form == "sharded", overlap=overlap, **options)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- backward(create_graph=True) ----------------------------------------------------------------------------


class _Square(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(n))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2).sum()


def create_graph_body(backend: dml.Backend, overlap: bool) -> int:
    """torch's test_ddp_create_graph: six backward(create_graph=True) passes accumulate 2p each, so .grad is 12, and
    it keeps its history; for a small parameter (a flat bucket) and a large one (reduced alone). The sharded form
    refuses, on every rank, before anything is reduced."""
    checked = 0
    for n, bucket_bytes in ((1, None), (70_000, 0)):
        model = _Square(n)
        opt = _wrap(backend, model, "plain", overlap, bucket_bytes=bucket_bytes)
        for _ in range(6):
            model().backward(create_graph=True)
            assert model.p.requires_grad and model.p.grad.requires_grad
        assert torch.equal(model.p.grad.detach(), torch.full((n,), 12.0)), model.p.grad
        # the history is the local gradient's: d/dp sum(grad) = 6 * 2 on every element
        (second,) = torch.autograd.grad(model.p.grad.sum(), model.p)
        assert torch.equal(second, torch.full((n,), 12.0)), second
        opt.zero_grad()
        checked += 1
    model = _Square(4)
    opt = _wrap(backend, model, "sharded", overlap)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*torch\.autograd\.grad"):
        model().backward(create_graph=True)
    opt.zero_grad()
    model().backward()  # the wrapper still works after the refusal
    opt.step()
    return checked + 1


# -- gradient penalties --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PenaltyCase:
    form: str
    overlap: bool
    via: str  # "autograd.grad": the input-gradient penalty; "create_graph": a penalty on the parameters' .grad
    seed: int


def penalty_cases() -> st.SearchStrategy[PenaltyCase]:
    plain = st.builds(
        PenaltyCase,
        st.just("plain"),
        st.booleans(),
        st.sampled_from(("autograd.grad", "create_graph")),
        st.integers(0, 99),
    )
    sharded = st.builds(PenaltyCase, st.just("sharded"), st.booleans(), st.just("autograd.grad"), st.integers(0, 99))
    return st.one_of(plain, sharded)


def _critic(seed: int) -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    return _init(net, seed)


def _penalty_loss(model: torch.nn.Module, x: torch.Tensor, via: str) -> torch.Tensor | None:
    """The loss whose backward() the step takes; for ``create_graph``, after a first backward of its own."""
    if via == "autograd.grad":  # WGAN-GP: per-sample input-gradient norms, penalized towards 1
        x = x.detach().requires_grad_(True)
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + ((gx.norm(dim=1) - 1) ** 2).mean()
    model(x).pow(2).mean().backward(create_graph=True)
    return sum(p.grad.pow(2).sum() for p in model.parameters())


def penalty_body(backend: dml.Backend, case: PenaltyCase) -> None:
    """Training with a gradient penalty equals one process on the whole batch (float64, three steps)."""
    w, rank, rows = backend.size, backend.rank, 4
    model = _critic(case.seed)
    ref = _critic(case.seed)
    opt = _wrap(backend, model, case.form, case.overlap)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + case.seed)
    for _ in range(3):
        batch = torch.randn(w * rows, 3, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        _penalty_loss(model, batch[rank * rows : (rank + 1) * rows], case.via).backward()
        opt.step()
        ref_opt.zero_grad()
        if case.via == "autograd.grad":
            _penalty_loss(ref, batch, case.via).backward()
        else:  # one process: the mean over the whole batch is the average of the ranks' means
            _penalty_loss(ref, batch, case.via).backward()
        ref_opt.step()
    got, want = _flat(model), _flat(ref)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-11), (case, (got - want).abs().max())
    every = dml.allgather_object(backend, got)
    assert all(torch.equal(other, got) for other in every), "ranks differ"


# -- activation checkpointing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointCase:
    form: str
    overlap: bool
    reentrant: bool
    where: str  # which layers are checkpointed: "first" two, "middle" one, "last" one, "all" (every layer)
    bucket_bytes: int | None


def checkpoint_cases() -> st.SearchStrategy[CheckpointCase]:
    return st.builds(
        CheckpointCase,
        st.sampled_from(FORMS),
        st.booleans(),
        st.booleans(),
        st.sampled_from(("first", "middle", "last", "all")),
        st.sampled_from((None, 0, 64)),
    )


class _Net(torch.nn.Module):
    def __init__(self, where: str | None, reentrant: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in ((5, 8), (8, 8), (8, 6), (6, 1)))
        self.where, self.reentrant = where, reentrant

    def _run(self, lo: int, hi: int, h: torch.Tensor) -> torch.Tensor:
        for k in range(lo, hi):
            h = self.layers[k](h)
            if k < len(self.layers) - 1:
                h = torch.tanh(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spans = {None: [], "first": [(0, 2)], "middle": [(1, 2)], "last": [(3, 4)], "all": [(0, 1), (1, 3), (3, 4)]}
        h, at = x, 0
        for lo, hi in spans[self.where]:
            h = self._run(at, lo, h)
            if self.reentrant and not h.requires_grad:
                h = h.detach().requires_grad_(True)  # reentrant checkpoint needs an input that requires grad
            h = checkpoint(self._run, lo, hi, h, use_reentrant=self.reentrant)
            at = hi
        return self._run(at, len(self.layers), h)


def checkpoint_body(backend: dml.Backend, case: CheckpointCase) -> None:
    """Checkpointed training (reentrant or not, any placement) equals the same model without checkpointing."""
    rank, rows = backend.rank, 3
    results = []
    for where in (case.where, None):
        model = _init(_Net(where, case.reentrant).double(), 7)
        opt = _wrap(backend, model, case.form, case.overlap, bucket_bytes=case.bucket_bytes)
        gen = torch.Generator().manual_seed(31 + rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(rows, 5, generator=gen, dtype=torch.float64)).pow(2).mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
        results.append((_flat(model), grads))
    (got, got_grads), (want, want_grads) = results
    if case.form == "plain":  # after backward every .grad is the average (the sharded form: this rank's shard only)
        for g, h in zip(got_grads, want_grads, strict=True):
            assert torch.allclose(g, h, rtol=1e-12, atol=1e-14), (case, (g - h).abs().max())
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), (case, (got - want).abs().max())
    every = dml.allgather_object(backend, got)
    assert all(torch.equal(other, got) for other in every), "ranks differ"


class _Shared(torch.nn.Module):
    """One layer used inside a reentrant-checkpointed block and again outside it."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.inner, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = lambda t: torch.tanh(self.inner(t))  # noqa: E731
        h = checkpoint(block, x, use_reentrant=True) if self.checkpointed else block(x)
        return self.head(torch.tanh(self.inner(h)))


def shared_across_body(backend: dml.Backend, form: str, overlap: bool) -> str:
    """A parameter used inside and outside a reentrant block: at the end of backward (overlap off) its two gradients
    are reduced together, as without checkpointing; with overlap its bucket may have gone: every rank raises."""
    results = []
    for checkpointed in (True, False):
        model = _init(_Shared(checkpointed).double(), 5)
        opt = _wrap(backend, model, form, overlap)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(backend.rank), dtype=torch.float64)
        x.requires_grad_(True)
        try:
            for _ in range(2):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
        except RuntimeError as err:
            assert overlap and checkpointed and "second gradient in one backward" in str(err), err
            opt.zero_grad()
            return "refused"
        results.append(_flat(model))
    assert not overlap
    assert torch.allclose(results[0], results[1], rtol=1e-12, atol=1e-14), (results[0] - results[1]).abs().max()
    return "equal"


# -- sparse gradients ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseCase:
    optimizer: str  # "sgd" (one optimizer over everything) or "sparseadam" (SparseAdam for the table, Adam else)
    form: str
    overlap: bool
    sparse_as_dense: bool
    bucket_bytes: int | None


def sparse_cases() -> st.SearchStrategy[SparseCase]:
    return st.builds(
        SparseCase,
        st.sampled_from(("sgd", "sparseadam")),
        st.sampled_from(FORMS),
        st.booleans(),
        st.booleans(),
        st.sampled_from((None, 0)),
    ).filter(lambda c: not (c.optimizer == "sparseadam" and (c.sparse_as_dense or c.form == "sharded")))


ROWS, DIM = 3000, 4


def _embedding_model() -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    emb, lin = torch.nn.Embedding(ROWS, DIM, sparse=True).double(), torch.nn.Linear(DIM, 1).double()
    _init(emb, 11)
    _init(lin, 12)
    return emb, lin


def _optimizers(case: SparseCase, emb: torch.nn.Module, lin: torch.nn.Module) -> list[torch.optim.Optimizer]:
    if case.optimizer == "sparseadam":
        return [torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), torch.optim.Adam(lin.parameters(), lr=0.1)]
    return [torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1, momentum=0.9)]


def sparse_embedding_body(backend: dml.Backend, case: SparseCase) -> None:
    """nn.Embedding(sparse=True) trains as one process on the whole batch; unsharded, after the first step the table
    never travels dense (no primitive carries ROWS * DIM elements) and .grad stays sparse, unless sparse_as_dense."""
    w, rank = backend.size, backend.rank
    emb, lin = _embedding_model()
    ref_emb, ref_lin = _embedding_model()
    opts = [
        dml.DistributedOptimizer(
            backend,
            o,
            shard_state=case.form == "sharded",
            overlap=case.overlap,
            sparse_as_dense=case.sparse_as_dense,
            bucket_bytes=case.bucket_bytes,
        )
        for o in _optimizers(case, emb, lin)
    ]
    refs = _optimizers(case, ref_emb, ref_lin)
    largest: list[int] = []

    def watch(name: str, original, *args):
        if name in ("_allreduce", "_reduce_scatter", "_allgather"):
            largest[-1] = max(largest[-1], *(a.size for a in args[:2] if hasattr(a, "size")))
        return original(*args)

    backend.observe(watch)
    try:
        for t in range(4):
            largest.append(0)
            idx = torch.randint(0, ROWS, (w, 5), generator=torch.Generator().manual_seed(70 + t))
            for o in opts:
                o.zero_grad()
            lin(emb(idx[rank])).pow(2).mean().backward()
            sparse_now = case.form == "plain" and not case.sparse_as_dense
            assert emb.weight.grad.is_sparse == sparse_now, (case, emb.weight.grad.layout)
            for o in opts:
                o.step()
            for o in refs:
                o.zero_grad()
            torch.stack([ref_lin(ref_emb(idx[r])).pow(2).mean() for r in range(w)]).mean().backward()
            for o in refs:
                o.step()
    finally:
        backend.observe(None)
    if w > 1 and case.form == "plain" and not case.sparse_as_dense:
        assert max(largest[1:]) < ROWS * DIM, (case, largest)  # the table went sparse after the first step
    elif w > 1:
        assert max(largest) >= ROWS * DIM // w, (case, largest)  # dense (the sharded form reduce-scatters it)
    for got, want in ((emb.weight, ref_emb.weight), (lin.weight, ref_lin.weight)):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (case, (got - want).abs().max())


# -- a user's gradient hooks, and an optimizer created again over the same parameters -------------------------

HOOK_WAYS = ("optimizer", "optimizer_sdb", "sharded", "sharded_sdb", "reduce_in_backward")
#: (the first reduction, the one created after it) over the same parameters
AGAIN = (
    ("optimizer", "optimizer"),
    ("sharded", "optimizer"),
    ("optimizer", "sharded_sdb"),
    ("reduce_in_backward", "optimizer"),
    ("optimizer", "reduce_in_backward"),
)


def _reduction(backend: dml.Backend, model: torch.nn.Module, way: str, overlap: bool, op: Any = dml.AVG) -> Any:
    """The way's reduction over ``model``: an optimizer (stepping or not during backward, sharded or not), or
    reduce_gradients_in_backward's handle."""
    if way == "reduce_in_backward":
        return dml.reduce_gradients_in_backward(backend, model, op, overlap=overlap)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    return dml.DistributedOptimizer(
        backend,
        inner,
        op=op,
        overlap=overlap,
        shard_state=way.startswith("sharded"),
        step_during_backward=way.endswith("_sdb"),
    )


def _hooked_model(seed: int) -> torch.nn.Sequential:
    """A 512 KiB weight (a bucket of its own at the default sizes) between two small layers."""
    return _init(torch.nn.Sequential(torch.nn.Linear(3, 256), torch.nn.Tanh(), torch.nn.Linear(256, 512)), seed)


def user_hook_body(backend: dml.Backend, way: str, overlap: bool, replace: bool) -> None:
    """A post-accumulate-grad hook the user registers after the reduction (doubling ``.grad`` in place, or
    replacing it) runs before the reduction, as under DDP: the reduced gradient is the average of the doubled
    ones, on every rank (with overlap the hook used to run after its bucket had gone: lost, or racing it, and a
    replaced gradient was left unreduced, the replicas diverging)."""
    rank, size = backend.rank, backend.size
    model = _hooked_model(5)
    reduction = _reduction(backend, model, way, overlap)

    def double(p: torch.Tensor) -> None:
        if replace:
            p.grad = p.grad * 2
        else:
            p.grad.mul_(2)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(double)
    ref = _hooked_model(5)
    before = [p.detach().clone() for p in model.parameters()]
    for r in range(size):
        (ref(torch.full((2, 3), float(r + 1))).pow(2).mean() * 2 / size).backward()
    model(torch.full((2, 3), float(rank + 1))).pow(2).mean().backward()
    if way == "reduce_in_backward":
        got = [p.grad for p in model.parameters()]
        reduction.remove()
    else:
        reduction.step()
        got = [(b - p.detach()) / 0.5 for b, p in zip(before, model.parameters(), strict=True)]
    for g, p in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    every = dml.allgather_object(backend, _flat(model))
    assert all(torch.equal(e, every[0]) for e in every), "replicas differ"


def created_again_body(backend: dml.Backend, first: str, second: str, op: str) -> None:
    """A second reduction over the same parameters (a new phase; or after freezing one, as the "parameters
    changed" error advises) takes them over: the first one's hooks are removed, the gradients are reduced once
    (SUM: not twice), the new one trains as one process would, and the first one's step() raises."""
    rank, size = backend.rank, backend.size
    reduce_op = dml.SUM if op == "sum" else dml.AVG
    model = _hooked_model(7)
    old = _reduction(backend, model, first, overlap=True, op=reduce_op)
    model(torch.full((2, 3), float(rank + 1))).pow(2).mean().backward()
    if first == "reduce_in_backward":
        for p in model.parameters():
            p.grad = None
    else:
        old.step()
        old.zero_grad()
    model[0].bias.requires_grad_(False)  # changed on every rank: the first reduction would refuse it
    new = _reduction(backend, model, second, overlap=True, op=reduce_op)
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    ref = _hooked_model(7)  # from where the second reduction starts (stepping during backward moves the model)
    with torch.no_grad():
        for q, p in zip(ref.parameters(), model.parameters(), strict=True):
            q.copy_(p)
    ref[0].bias.requires_grad_(False)
    model(torch.full((2, 3), float(rank + 1))).pow(2).mean().backward()
    for r in range(size):
        loss = ref(torch.full((2, 3), float(r + 1))).pow(2).mean()
        (loss if op == "sum" else loss / size).backward()
    if second == "reduce_in_backward":
        got = [p.grad for p in model.parameters() if p.requires_grad]
    else:
        new.step()
        got = [
            (b - p.detach()) / 0.5
            for b, p in zip(start, (p for p in model.parameters() if p.requires_grad), strict=True)
        ]
    want = [p.grad for p in ref.parameters() if p.requires_grad]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if first != "reduce_in_backward":
        with pytest.raises(RuntimeError, match="took over their gradient reduction"):
            old.step()


def changed_data_body(backend: dml.Backend, way: str, overlap: bool, how: str, only_rank_0: bool) -> None:
    """A parameter's ``.data`` replaced after the first backward by one of another shape (an output layer grown in
    place) or dtype (``model.double()``), on every rank or on rank 0 only: the next backward raises the documented
    "parameters changed" error on every rank (not torch's error about a gradient that does not fit its bucket);
    an optimizer created again then trains the changed model."""
    rank = backend.rank
    model = _init(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)), 3)
    reduction = _reduction(backend, model, way, overlap)
    model(torch.ones(2, 4)).sum().backward()
    reduction.step()
    reduction.zero_grad()
    dtype = torch.float32
    if not only_rank_0 or rank == 0:
        if how == "shape":
            model[2].weight.data = torch.zeros(2, 8)
            model[2].bias.data = torch.zeros(2)
        else:
            model.double()
            dtype = torch.float64
    with pytest.raises(RuntimeError, match="the parameters changed after the"):
        model(torch.ones(2, 4, dtype=dtype)).sum().backward()
    if only_rank_0:
        return
    model.zero_grad()
    again = _reduction(backend, model, way, overlap)
    start = _flat(model).clone()
    model(torch.full((2, 4), float(rank + 1), dtype=dtype)).sum().backward()
    again.step()
    moved = dml.allgather_object(backend, _flat(model) - start)
    assert all(torch.equal(m, moved[0]) for m in moved) and bool(moved[0].abs().sum() > 0), moved


def converted_body(backend: dml.Backend, way: str, overlap: bool) -> None:
    """What a model may go through after the reduction is created, before its first backward: a parameter swapped
    with ``torch.utils.swap_tensors`` (the library keeps no weak reference to parameters) and ``model.double()`` (a
    new AccumulateGrad node per parameter: the reduction follows it, once per backward; the sharded form, whose
    parameters are views of its buffers, refuses it on every rank)."""
    rank = backend.rank
    model = _init(torch.nn.Sequential(torch.nn.Linear(3, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256)), 9)
    reduction = _reduction(backend, model, way, overlap)
    torch.utils.swap_tensors(model[0].bias, torch.nn.Parameter(model[0].bias.detach().clone()))
    model.double()
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
    if way.startswith("sharded"):
        with pytest.raises(RuntimeError, match="the parameters changed after the sharded layout was built"):
            model(x).pow(2).mean().backward()
        return
    ref = copy.deepcopy(model)
    start = _flat(model).clone()
    model(x).pow(2).mean().backward()
    for r in range(backend.size):
        (ref(torch.full((2, 3), float(r + 1), dtype=torch.float64)).pow(2).mean() / backend.size).backward()
    if way == "reduce_in_backward":
        got = [p.grad for p in model.parameters()]
    else:
        reduction.step()
        got = list(torch.split((start - _flat(model)) / 0.5, [p.numel() for p in model.parameters()]))
    for g, p in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(g.reshape(p.shape), p.grad, rtol=1e-9, atol=1e-12)
