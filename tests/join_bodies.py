"""Bodies of tests/test_join.py (dml.join, uneven inputs), run on simulated ranks and under mpiexec (tests/join_job.py).

Rank r trains on ``batches[r]`` batches. The reference, computed alone on every rank: one process that, at
iteration t, averages the losses of the ranks that still have a batch t and steps on that.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.objects import run_on_root


@dataclass(frozen=True)
class JoinCase:
    batches: tuple[int, ...]  # per rank; the world size is its length
    overlap: bool
    batchnorm: bool  # a SyncBatchNorm layer and rank 0's buffers broadcast before each forward
    bucket_bytes: int | None


def join_cases(world: int | None = None) -> st.SearchStrategy[JoinCase]:
    sizes = st.integers(1, 4) if world is None else st.just(world)
    return sizes.flatmap(
        lambda w: st.builds(
            JoinCase,
            st.lists(st.integers(0, 4), min_size=w, max_size=w).filter(any).map(tuple),
            st.booleans(),
            st.booleans(),
            st.sampled_from((None, 0)),
        )
    )


def _model(batchnorm: bool) -> torch.nn.Module:
    layers = [torch.nn.Linear(3, 6)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(6))
    layers += [torch.nn.Tanh(), torch.nn.Linear(6, 1)]
    model = torch.nn.Sequential(*layers).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model


def _batch(rank: int, t: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * rank + t), dtype=torch.float64)


def _reference(case: JoinCase) -> torch.nn.Module:
    """One process: at iteration t, the ranks with a batch t; BatchNorm over all their rows together."""
    model = _model(case.batchnorm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(max(case.batches)):
        have = [r for r, n in enumerate(case.batches) if n > t]
        opt.zero_grad()
        if case.batchnorm:  # SyncBatchNorm: statistics over every row of every rank with data
            out = model(torch.cat([_batch(r, t) for r in have]))
            losses = out.pow(2).view(len(have), -1).mean(dim=1)
        else:
            losses = torch.stack([model(_batch(r, t)).pow(2).mean() for r in have])
        losses.mean().backward()
        opt.step()
    return model


def join_body(backend: dml.Backend, case: JoinCase) -> None:
    rank = backend.rank
    model = _model(case.batchnorm)
    if case.batchnorm:
        model = dml.convert_sync_batchnorm(backend, model)
    opt = dml.DistributedOptimizer(
        backend,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        overlap=case.overlap,
        bucket_bytes=case.bucket_bytes,
    )
    handles = [dml.broadcast_buffers(backend, model)] if case.batchnorm else []
    with dml.join(backend, opt, model, *handles):
        for t in range(case.batches[rank]):
            opt.zero_grad()
            model(_batch(rank, t)).pow(2).mean().backward()
            opt.step()
    want = _reference(case)
    for (name, got), ref in zip(model.state_dict().items(), want.state_dict().values(), strict=True):
        if got.dtype.is_floating_point:
            assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12), (case, name, (got - ref).abs().max())
    every = dml.allgather_object(backend, [t.clone() for t in model.state_dict().values()])
    assert all(torch.equal(a, b) for other in every for a, b in zip(other, every[0], strict=True)), "ranks differ"
    # the wrapper works as before after the block
    opt.zero_grad()
    model(_batch(rank, 99)).pow(2).mean().backward()
    opt.step()


def refusals_body(backend: dml.Backend) -> None:
    """Bad joinables raise TypeError on every rank before any communication."""
    model = torch.nn.Linear(2, 1)
    sharded = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
    with pytest.raises(TypeError, match="shard_state=True"):
        dml.join(backend, sharded)
    with pytest.raises(TypeError, match=r"pass the loop's dml\.DistributedOptimizer"):
        dml.join(backend, model)
    with pytest.raises(TypeError, match=r"allowed: the dml\.DistributedOptimizer"):
        dml.join(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="backend"):
        dml.join(None, model)
    dml.barrier(backend)


class _Tagged(torch.nn.Module):
    """A sparse embedding of a tag drawn from each row, added to the row, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 3, sparse=True, dtype=torch.float64)
        self.lin = torch.nn.Linear(3, 1, dtype=torch.float64)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tags = (x[:, 0].abs() * 10).long() % 6
        return self.lin(x + self.emb(tags))


def sparse_join_body(backend: dml.Backend, batches: tuple[int, ...], sparse_as_dense: bool) -> None:
    """Sparse embedding gradients under dml.join: averaged over the ranks that have data at each iteration (a
    joined rank contributes no entries), as one process with a dense embedding on their batches gives."""
    rank = backend.rank
    model = _Tagged()
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), sparse_as_dense=sparse_as_dense
    )
    with dml.join(backend, opt, model):
        for t in range(batches[rank]):
            opt.zero_grad()
            model(_batch(rank, t)).pow(2).mean().backward()
            opt.step()
    want = _Tagged()
    want.emb.sparse = False
    ref = torch.optim.SGD(want.parameters(), lr=0.1)
    for t in range(max(batches)):
        have = [r for r, n in enumerate(batches) if n > t]
        ref.zero_grad()
        torch.stack([want(_batch(r, t)).pow(2).mean() for r in have]).mean().backward()
        ref.step()
    for (name, got), expected in zip(model.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), (batches, name, got, expected)


def rooted_calls_body(backend: dml.Backend, batches: tuple[int, ...], root: int) -> None:
    """Inside the block, after each step: rooted calls rooted at ``root``, whether ``root`` still has data or has
    joined (then the lowest rank with data acts as root): bcast (both forms), reduce, bcast_object, run_on_root,
    synchronize, dml.save / dml.load, and a TrainState save, each from that rank's data."""
    rank, world = backend.rank, backend.size
    where = dml.bcast_object(backend, tempfile.mkdtemp() if rank == 0 else None)
    model = _model(False)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    state = dml.TrainState(backend, model=model, optimizer=opt, step=0)
    with dml.join(backend, opt, model):
        for t in range(batches[rank]):
            opt.zero_grad()
            model(_batch(rank, t)).pow(2).mean().backward()
            opt.step()
            active = [r for r in range(world) if batches[r] > t]
            acting = root if root in active else active[0]
            assert backend.acting_root(root) == acting, (t, backend.acting_root(root), acting)
            mine = torch.full((3,), float(rank))
            got = dml.bcast(backend, mine.clone(), root=root)
            assert torch.equal(got, torch.full((3,), float(acting))), (t, got)
            out = torch.full((3,), -1.0)
            dml.bcast(backend, mine, out, root=root)
            assert torch.equal(out, torch.full((3,), float(acting))), (t, out)
            total = dml.reduce(backend, torch.tensor([rank + 1.0]), dml.SUM, root=root)
            if rank == acting:
                assert total.item() == sum(r + 1.0 for r in active), (t, total)
            assert dml.bcast_object(backend, ("from", rank), root=root) == ("from", acting)
            assert run_on_root(backend, lambda: backend.rank, root=root) == acting
            synced = dml.synchronize(backend, {"v": torch.tensor([rank])}, root=root)
            assert synced["v"].item() == acting
            writer = 0 if 0 in active else active[0]  # dml.save and dml.load: rank 0's, or the acting rank's
            dml.save(backend, {"t": t, "by": rank, "model": model}, os.path.join(where, "ckpt.pt"))
            back = dml.load(backend, os.path.join(where, "ckpt.pt"))
            assert (back["t"], back["by"]) == (t, writer), (t, back["t"], back["by"])
            state.step = t + 1
            state.save(where)
    state.wait()
    fresh = dml.TrainState(backend, model=_model(False), optimizer=None, step=-1)
    assert fresh.resume(where)
    assert fresh.step == max(batches), (fresh.step, batches)


#: Where calls_around_the_step_body makes its calls.
AROUND = ("before", "after", "both", "evaluate")


def calls_around_the_step_body(backend: dml.Backend, batches: tuple[int, ...], where: str) -> None:
    """Loss-like sums in every iteration, made before the forward, after the step (a rank may leave right after
    them) or both: the ranks with a batch t sum their ones, the joined ones add zeros."""
    rank = backend.rank
    model = _model(False)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    with dml.join(backend, opt, model):
        for t in range(batches[rank]):
            want = float(sum(b > t for b in batches))
            if where in {"before", "both"}:
                assert dml.allreduce(backend, torch.ones(2), dml.SUM).tolist() == [want] * 2, (t, batches)
            opt.zero_grad()
            model(_batch(rank, t)).pow(2).mean().backward()
            opt.step()
            if where in {"after", "both"}:
                assert dml.allreduce(backend, torch.ones(2), dml.SUM).tolist() == [want] * 2, (t, batches)
            if where == "evaluate":  # a validation forward after the step (eval mode, or no_grad), its loss averaged
                model.eval()
                with torch.no_grad() if t % 2 else contextlib.nullcontext():
                    loss = model(_batch(rank, 50 + t)).pow(2).mean()
                model.train()
                assert dml.allreduce(backend, torch.ones(2), dml.SUM).tolist() == [want] * 2, (t, batches)
                assert torch.isfinite(loss)
                assert dml.bcast_object(backend, rank) == (
                    0 if batches[0] > t else min(r for r, b in enumerate(batches) if b > t)
                )
    everyone = dml.allgather_object(backend, [p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, everyone[0], strict=True)), "ranks differ"


def join_uneven_batches(world: int | None = None) -> st.SearchStrategy[tuple[int, ...]]:
    sizes = st.integers(1, 4) if world is None else st.just(world)
    return sizes.flatmap(lambda w: st.lists(st.integers(0, 4), min_size=w, max_size=w).filter(any).map(tuple))


def averages_skips_and_buffers_body(backend: dml.Backend, batches: tuple[int, ...]) -> None:
    """Inside the block: dml.AVG of the user's is over the ranks with data (as the gradients are); a step that a
    GradScaler skips (inf loss) while a rank leaves after it; buffers broadcast by a handle join was not given;
    a second join inside the first is refused."""
    rank = backend.rank

    def train(pass_handle: bool) -> list[torch.Tensor]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
        gen = torch.Generator().manual_seed(5)  # the simulated ranks share one global generator: not that one
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        handle = dml.broadcast_buffers(backend, model)
        with dml.join(backend, opt, model, *([handle] if pass_handle else [])):
            with pytest.raises(RuntimeError, match="already open"):
                dml.join(backend, opt).__enter__()
            for t in range(batches[rank]):
                opt.zero_grad()
                loss = model(_batch(rank, t)).pow(2).mean()
                scaler.scale(loss * (float("inf") if t == 1 else 1.0)).backward()
                scaler.step(opt)  # skipped at t == 1, on every rank with data
                scaler.update()
                active = [r for r in range(backend.size) if batches[r] > t]
                mean = sum(r + 1.0 for r in active) / len(active)
                got = dml.allreduce(backend, torch.tensor([rank + 1.0]), dml.AVG)
                assert got.item() == pytest.approx(mean), (t, got, mean)
                at = dml.reduce(backend, np.array([rank + 1.0]), dml.AVG, root=0)
                if rank == backend.acting_root(0):
                    assert at[0] == pytest.approx(mean), (t, at, mean)
        return [t.detach().clone() for t in model.state_dict().values()]

    passed, not_passed = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(passed, not_passed, strict=True)), "a handle not given to join"
    everyone = dml.allgather_object(backend, passed)
    assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, everyone[0], strict=True)), "ranks differ"


def skips_and_odd_forwards_body(backend: dml.Backend, batches: tuple[int, ...]) -> None:
    """Inside the block: a GradScaler-skipped step followed by a collective before the next forward; an iteration
    every rank with data skips by its own agreement (no backward); a forward that rank 0 alone makes after the
    step (no_grad) and one inside run_on_root (train mode); sparse_allreduce and allreduce_gradients averaging over
    the ranks with data; at the end equal buffers (the last steps skipped) and, passed to join, equal LR schedulers
    and GradScalers."""
    rank, world = backend.rank, backend.size
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    with dml.join(backend, opt, model, sched, scaler):
        for t in range(batches[rank]):
            active = [r for r in range(world) if batches[r] > t]
            mean = sum(r + 1.0 for r in active) / len(active)
            if t % 3 != 0:  # before the forward; not after an iteration skipped without a backward (see docs)
                assert dml.allreduce(backend, torch.ones(1), dml.SUM).item() == len(active), t
            loss = model(_batch(rank, t)).pow(2).mean()
            if dml.allreduce(backend, torch.tensor([float(t % 3 == 2)]), dml.MAX).item():
                continue  # skipped by every rank with data, before any backward
            opt.zero_grad()
            scaler.scale(loss * (float("inf") if t % 3 == 1 else 1.0)).backward()
            scaler.step(opt)  # skipped at t % 3 == 1
            scaler.update()
            sched.step()
            if rank == 0:
                with torch.no_grad():
                    model(_batch(rank, 70))  # rank 0 alone: no collective
            run_on_root(backend, lambda: float(model(_batch(0, 80)).sum()))  # a training-mode forward on root only
            sparse = torch.sparse_coo_tensor([[0]], [rank + 1.0], (2,), check_invariants=True)
            assert dml.sparse_allreduce(backend, sparse, dml.AVG).to_dense()[0].item() == pytest.approx(mean)
            for p in model.parameters():
                p.grad = torch.full_like(p, rank + 1.0)
            dml.allreduce_gradients(backend, model, dml.AVG)
            assert all(torch.allclose(p.grad, torch.full_like(p, mean)) for p in model.parameters()), t
    state = [t.detach().clone() for t in model.state_dict().values()]
    everyone = dml.allgather_object(backend, (state, sched.state_dict()["last_epoch"], scaler.get_scale()))
    for other in everyone:
        assert all(torch.equal(a, b) for a, b in zip(other[0], everyone[0][0], strict=True)), "buffers differ"
        assert other[1:] == everyone[0][1:], (other[1:], everyone[0][1:])
