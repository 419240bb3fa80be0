"""Bodies of the sharded-optimizer tests (``shard_state=True``), run on LocalBackend.spawn and under mpiexec
(tests/sharded_job.py).

Every comparison runs the sharded optimizer and the unsharded ``DistributedOptimizer`` side by side on the
same backend, on identical models fed identical data, and compares them after every step: bit for bit where
the sums are the same (LocalBackend adds in rank order for both collectives; any backend adds two numbers
alike), else within ``TOLERANCE`` (MPI on 3 ranks: ``Reduce_scatter_block`` and ``Allreduce`` may add in other
orders).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.objects import run_on_root

from reducer_bodies import TwoWay
from train_bodies import _gen, replicas_identical

KINDS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "adamax", "nadam", "radam", "asgd", "adadelta", "rprop")
#: (rtol, atol) where the sums may differ in rounding: float32 gradients, a few steps.
TOLERANCE = {None: (1e-4, 1e-5), "bfloat16": (1e-2, 1e-3)}
#: Bytes of device memory that consolidating or loading the state may take beyond one entry's shard.
SLACK = 1 << 20


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """An elementwise optimizer with state (momentum for SGD) and weight decay where it has one."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "rprop":
        return torch.optim.Rprop(params, lr=0.01)
    if kind == "adadelta":
        return torch.optim.Adadelta(params, lr=0.5, weight_decay=0.01)
    cls = {
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "rmsprop": torch.optim.RMSprop,
        "adagrad": torch.optim.Adagrad,
        "adamax": torch.optim.Adamax,
        "nadam": torch.optim.NAdam,
        "radam": torch.optim.RAdam,
        "asgd": torch.optim.ASGD,
    }[kind]
    return cls(params, lr=0.01, weight_decay=0.01)


class Net(torch.nn.Module):
    """An MLP of ``widths``, a side layer used on odd ranks only ("some") and a parameter no rank uses."""

    def __init__(self, widths: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = _gen(seed)
        layers: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        self.body = torch.nn.Sequential(*layers[:-1])
        self.side = torch.nn.Linear(widths[0], widths[-1])
        self.never = torch.nn.Parameter(torch.zeros(3))
        self.to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        out = self.body(x)
        return out + self.side(x) if side else out


@dataclass(frozen=True)
class ShardCase:
    seed: int
    widths: tuple[int, ...]
    kind: str
    bucket_bytes: int
    overlap: bool
    op: str  # "avg" or "sum"
    wire: str | None  # communication_dtype: None or "bfloat16"
    micro: int  # micro-batches per step
    accumulate: str  # "no_sync" (DDP's way) or "passes" (backward_passes_per_step)
    unused: str  # "none", "some" (the side layer on odd ranks) or "all" (the side layer nowhere)
    scheduler: bool
    synchronize: bool  # opt.synchronize() before step()
    groups: bool  # two parameter groups with different learning rates
    steps: int


@st.composite
def shard_cases(draw: st.DrawFn, kinds: tuple[str, ...] = ("sgd", "adam")) -> ShardCase:
    return ShardCase(
        seed=draw(st.integers(0, 10**6)),
        widths=tuple(draw(st.lists(st.integers(1, 24), min_size=2, max_size=4))),
        kind=draw(st.sampled_from(kinds)),
        bucket_bytes=draw(st.sampled_from([0, 64, 1024, 1 << 20])),
        overlap=draw(st.booleans()),
        op=draw(st.sampled_from(["avg", "sum"])),
        wire=draw(st.sampled_from([None, None, "bfloat16"])),
        micro=draw(st.integers(1, 3)),
        accumulate=draw(st.sampled_from(["no_sync", "passes"])),
        unused=draw(st.sampled_from(["none", "some", "all"])),
        scheduler=draw(st.booleans()),
        synchronize=draw(st.booleans()),
        groups=draw(st.booleans()),
        steps=draw(st.integers(1, 3)),
    )


def fixed_case(kind: str = "adam", **changes: Any) -> ShardCase:
    """A case that exercises most paths at once (accumulation, unused parameters, a scheduler)."""
    values: dict[str, Any] = {
        "seed": 5,
        "widths": (5, 9, 3),
        "kind": kind,
        "bucket_bytes": 64,
        "overlap": False,
        "op": "avg",
        "wire": None,
        "micro": 2,
        "accumulate": "no_sync",
        "unused": "some",
        "scheduler": True,
        "synchronize": False,
        "groups": True,
        "steps": 3,
    }
    values.update(changes)
    return ShardCase(**values)


def exact(backend: dml.Backend) -> bool:
    """Whether the sharded and unsharded reductions add in the same order (then results are bitwise equal)."""
    return isinstance(backend, dml.LocalBackend) or dml.total_workers(backend) <= 2


def check_close(backend: dml.Backend, got: torch.Tensor, want: torch.Tensor, what: str, wire: str | None) -> None:
    if exact(backend):
        assert torch.equal(got, want), f"{what}: differs by up to {(got - want).abs().max()}"
    else:
        rtol, atol = TOLERANCE[wire]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _param_groups(model: Net, groups: bool) -> Any:
    if not groups:
        return model.parameters()
    first = list(model.body.parameters())
    return [{"params": first}, {"params": [*model.side.parameters(), model.never], "lr": 0.003}]


def _batch(case: ShardCase, step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(3, case.widths[0], generator=_gen(case.seed + 1000 * step + 10 * micro + 7 + 97 * rank))


def _state_equal(backend: dml.Backend, got: dict[str, Any], want: dict[str, Any], wire: str | None) -> None:
    """``got`` (a sharded optimizer's consolidated state) is ``want``, with every tensor on the CPU."""
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])
    assert sorted(got["state"]) == sorted(want["state"]), (sorted(got["state"]), sorted(want["state"]))
    for i, entries in want["state"].items():
        assert list(got["state"][i]) == list(entries), (i, list(got["state"][i]), list(entries))
        for k, v in entries.items():
            g = got["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert g.shape == v.shape and g.dtype == v.dtype and g.device.type == "cpu", (i, k, g, v)
                check_close(backend, g, v.cpu(), f"state[{i}][{k!r}]", wire)
            else:
                assert g == v, (i, k, g, v)


def consolidated_equal(backend: dml.Backend, sharded: Any, unsharded: Any, wire: str | None) -> None:
    """``state_dict()`` is the unsharded optimizer's state on rank 0 alone (None on the others), on the CPU;
    ``state_dict(to=None)`` is on every rank."""
    want = unsharded.state_dict()
    got = sharded.state_dict()
    if dml.local_rank(backend) == 0:
        _state_equal(backend, got, want, wire)
    else:
        assert got is None, f"rank {dml.local_rank(backend)}: state_dict() returned the state off rank 0"
    _state_equal(backend, sharded.state_dict(to=None), want, wire)


def equivalence_body(backend: dml.Backend, case: ShardCase) -> list[float]:
    """Sharded and unsharded DistributedOptimizer side by side: after each backward this rank's shard of
    ``.grad`` is the unsharded one (and ``.grad`` is None exactly where it is there); after each step the
    parameters are equal; at the end ``state_dict()`` is the unsharded one and the replicas are identical."""
    rank = dml.local_rank(backend)
    models = [Net(case.widths, case.seed), Net(case.widths, case.seed)]
    kwargs: dict[str, Any] = {
        "op": {"avg": dml.AVG, "sum": dml.SUM}[case.op],
        "bucket_bytes": case.bucket_bytes,
        "communication_dtype": getattr(torch, case.wire) if case.wire else None,
        "overlap": case.overlap,
        "backward_passes_per_step": case.micro if case.accumulate == "passes" else 1,
    }
    opts = [
        dml.DistributedOptimizer(
            backend, make_optimizer(case.kind, _param_groups(m, case.groups)), shard_state=s, **kwargs
        )
        for m, s in zip(models, (True, False), strict=True)
    ]
    sharded = opts[0]
    assert isinstance(sharded, dml.ShardedOptimizer) and isinstance(sharded, dml.DistributedOptimizer)
    assert not isinstance(opts[1], dml.ShardedOptimizer)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) if case.scheduler else None for o in opts]
    side = case.unused == "some" and rank % 2 == 1
    for step in range(case.steps):
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            for m in range(case.micro):
                quiet = case.accumulate == "no_sync" and m < case.micro - 1
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    model(_batch(case, step, m, rank), side=side).pow(2).mean().backward()
            if case.synchronize:
                opt.synchronize()
        _check_grads(backend, opts, case)
        for opt, sched in zip(opts, scheds, strict=True):
            opt.step()
            if sched is not None:
                sched.step()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            check_close(backend, p.detach(), q.detach(), f"step {step}: {name}", case.wire)
    consolidated_equal(backend, sharded, opts[1], case.wire)
    flat = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()]).tolist()
    replicas_identical(backend, flat)
    return flat


def _check_grads(backend: dml.Backend, opts: list[Any], case: ShardCase) -> None:
    """This rank's shard of the sharded ``.grad`` is the unsharded ``.grad``; None in the same places."""
    ours, ref = ([p for g in opt.param_groups for p in g["params"]] for opt in opts)
    for p, q in zip(ours, ref, strict=True):
        assert (p.grad is None) == (q.grad is None), (p.shape, p.grad, q.grad)
    for pc in opts[0]._pieces:
        q = ref[pc.index]
        if q.grad is None or pc.grad is None:
            continue
        want = q.grad.reshape(-1)[pc.lo : pc.hi]
        check_close(backend, pc.grad.reshape(-1), want, f"grad of parameter {pc.index}", case.wire)


def kinds_body(backend: dml.Backend, kind: str) -> list[float]:
    """Every elementwise optimizer: the fixed case, at the end of backward and with overlap."""
    flat = equivalence_body(backend, fixed_case(kind))
    equivalence_body(backend, fixed_case(kind, overlap=True, accumulate="passes", groups=False, unused="all"))
    return flat


# -- checkpoints ------------------------------------------------------------------------------------


def resume_body(
    backend: dml.Backend,
    steps: int,
    start: dict[str, Any] | None,
    sharded: bool = True,
    op: str = "max",
) -> dict[str, Any]:
    """``steps`` steps from ``start`` (or from scratch); returns a checkpoint of the end, the same on every rank
    but for a sharded optimizer's state, which ``opt.state_dict()`` returns on rank 0 alone (None elsewhere).

    ``op="max"``: data that is the same on every rank, reduced with ``dml.MAX``, which makes the run
    independent of the number of ranks bit for bit, so a run resumed from a checkpoint of another world size
    must match an uninterrupted one exactly. ``op="avg"``: each rank its own batch, averaged (``dml.AVG``): the
    run depends on the number of ranks. Either way the optimizer state right after ``load_state_dict(start)``,
    consolidated again (``state_dict(to=None)``), must be the saved one bit for bit.
    """
    rank = dml.local_rank(backend)
    model = Net((4, 7, 3), 11)
    opt = dml.DistributedOptimizer(
        backend,
        make_optimizer("adam", _param_groups(model, True)),
        op={"max": dml.MAX, "avg": dml.AVG}[op],
        bucket_bytes=64,
        shard_state=sharded,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    first = 0
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
        sched.load_state_dict(start["sched"])
        first = start["step"]
        loaded = opt.state_dict(to=None) if sharded else copy.deepcopy(opt.state_dict())
        optimizer_states_equal(loaded, start["opt"])
    for step in range(first, first + steps):
        x = torch.randn(5, 4, generator=_gen(1000 + step + (100 * rank if op == "avg" else 0)))
        opt.zero_grad()
        model(x, side=step % 2 == 0).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": first + steps,
    }


def optimizer_states_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: parameter groups, state keys, and every entry's value, shape and dtype."""
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])
    assert sorted(got["state"]) == sorted(want["state"]), (sorted(got["state"]), sorted(want["state"]))
    for i, entries in want["state"].items():
        assert list(got["state"][i]) == list(entries), i
        for k, v in entries.items():
            g = got["state"][i][k]
            assert torch.equal(g, v) and g.dtype == v.dtype, (i, k, g, v)


def checkpoints_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: parameters, optimizer state (keys, shapes, values) and scheduler."""
    assert got["step"] == want["step"] and got["sched"] == want["sched"], (got["sched"], want["sched"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    optimizer_states_equal(got["opt"], want["opt"])


def every_rank_resumed(every: list[dict[str, Any]], want: dict[str, Any], sharded: bool) -> None:
    """Each rank's checkpoint from ``resume_body`` is ``want``; a sharded optimizer's state is on rank 0 alone."""
    for rank, checkpoint in enumerate(every):
        if sharded and rank > 0:
            assert checkpoint["opt"] is None, f"rank {rank}: opt.state_dict() returned the full state off rank 0"
        checkpoints_equal({**checkpoint, "opt": every[0]["opt"] if sharded else checkpoint["opt"]}, want)


def save_body(backend: dml.Backend, path: str, steps: int, sharded: bool = True, op: str = "max") -> dict[str, Any]:
    """``resume_body`` from scratch, then ``dml.save`` of its checkpoint (``opt.state_dict()`` on every rank)."""
    checkpoint = resume_body(backend, steps, None, sharded, op)
    dml.save(backend, checkpoint, path)
    return checkpoint


def load_body(backend: dml.Backend, path: str, steps: int, sharded: bool = True, op: str = "max") -> dict[str, Any]:
    """``dml.load`` a checkpoint (of any world size) and go on ``steps`` steps."""
    return resume_body(backend, steps, dml.load(backend, path), sharded, op)


def _expect(fn: Any, error: type[Exception], fragment: str) -> str:
    """Run ``fn``, which must raise ``error`` with ``fragment`` in its message; return the message."""
    try:
        fn()
    except error as e:
        assert fragment in str(e), f"{fragment!r} not in {e}"
        return str(e)
    raise AssertionError(f"no {error.__name__} with {fragment!r}")


def state_to_body(backend: dml.Backend) -> list[str]:
    """``state_dict(to)``: the unsharded optimizer's state on rank ``to`` alone (None on the others), on the CPU,
    on every rank with ``to=None``. A bad ``to`` raises before any communication (a barrier after a rank that
    alone passed one still pairs) with the same message on every rank; ranks passing different ``to`` raise on
    every rank. ``load_state_dict`` of None or of a dict that is no state raises and changes nothing; a load
    casts as torch does and keeps no reference to the tensors it was given. Returns the messages."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    models = [Net((5, 9, 3), 6), Net((5, 9, 3), 6)]
    opts = [
        dml.DistributedOptimizer(
            backend, make_optimizer("adam", _param_groups(m, True)), bucket_bytes=64, shard_state=s
        )
        for m, s in zip(models, (True, False), strict=True)
    ]
    sharded = opts[0]

    def train(steps: int) -> None:
        for step in range(steps):
            for model, opt in zip(models, opts, strict=True):
                opt.zero_grad()
                model(torch.randn(3, 5, generator=_gen(10 * step + rank)), side=True).pow(2).mean().backward()
                opt.step()
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            check_close(backend, p.detach(), q.detach(), "parameters", None)

    train(2)
    want = copy.deepcopy(opts[1].state_dict())
    for to in [*range(size), None, np.int64(size - 1)]:
        got = sharded.state_dict(to=to)
        if to is None or to == rank:
            _state_equal(backend, got, want, None)
        else:
            assert got is None, f"rank {rank}: state_dict(to={to}) returned the state"
    _state_equal(backend, sharded.state_dict(to=None), want, None)
    if rank == 0:
        _state_equal(backend, sharded.state_dict(0), want, None)  # positional
    else:
        assert sharded.state_dict(0) is None

    seen = []
    for bad, error, fragment in [
        (-1, ValueError, "to: got -1"),
        (size, ValueError, f"to: got {size}, but this job has {size} rank(s)"),
        ("0", TypeError, "to: got str '0'"),
        (1.0, TypeError, "to: got float 1.0"),
        (True, TypeError, "to: got bool True"),
    ]:
        for culprit in range(size):  # on one rank alone: it raises there, and the barrier still pairs
            if rank == culprit:
                _expect(lambda bad=bad: sharded.state_dict(to=bad), error, fragment)
            dml.barrier(backend)
        message = _expect(lambda bad=bad: sharded.state_dict(to=bad), error, fragment)  # on every rank
        assert dml.allgather_object(backend, message) == [message] * size
        seen.append(message)
    if size > 1:  # valid but different: every rank raises, after the small allgather
        message = _expect(lambda: sharded.state_dict(to=rank), ValueError, "rank 0 passed 0, rank 1 1")
        assert dml.allgather_object(backend, message) == [message] * size
        seen.append(message)

    for bad, error, fragment in [
        (None, TypeError, "got NoneType"),
        (None, TypeError, "opt.state_dict(to=None)"),
        ({"opt": want}, ValueError, "has no 'state' or 'param_groups' (its keys: 'opt')"),
        ({"state": {}, "param_groups": want["param_groups"][:1]}, ValueError, "has 1 parameter groups"),
        ({"state": [], "param_groups": []}, TypeError, "'state' is a list"),
    ]:
        seen.append(_expect(lambda bad=bad: sharded.load_state_dict(bad), error, fragment))
    groups = copy.deepcopy(want["param_groups"])
    groups[0]["params"] = groups[0]["params"][:-1]
    seen.append(_expect(lambda: sharded.load_state_dict({"state": {}, "param_groups": groups}), ValueError, "group 0"))
    _state_equal(backend, sharded.state_dict(to=None), want, None)  # nothing changed

    # torch's casting: floating entries to the parameter's dtype, step as given.
    doubled = copy.deepcopy(want)
    for entries in doubled["state"].values():
        for k in entries:
            entries[k] = entries[k].double()
    sharded.load_state_dict(doubled)
    for state in sharded.shard_optimizer.state.values():
        assert state["step"].dtype == torch.float64 and state["exp_avg"].dtype == torch.float32, state
    # The given tensors are not kept: changing them afterwards changes nothing.
    given = copy.deepcopy(want)
    sharded.load_state_dict(given)
    for entries in given["state"].values():
        for v in entries.values():
            v.fill_(float("nan"))
    _state_equal(backend, sharded.state_dict(to=None), want, None)
    train(1)
    consolidated_equal(backend, sharded, opts[1], None)
    return seen


def state_memory_body(backend: dml.Backend, device: str) -> dict[str, int]:
    """``state_dict()`` and ``load_state_dict`` cost no more device memory than this rank's shard of one entry.

    Adam over six 512x512 Linear layers (one state entry, 6.3 MB, is half the state; a rank's shard of it a
    W-th of that) trains a few steps on ``device``. Then ``state_dict()`` (the full state on rank 0, on the
    CPU), ``state_dict(to=None)`` and ``load_state_dict`` of that full CPU state (as ``dml.load`` returns a
    checkpoint) each raise the peak of allocated CUDA memory (``torch.cuda.max_memory_allocated``, per process:
    one rank per process, as under mpiexec) by at most this rank's shard of one entry plus ``SLACK`` bytes.
    The round trip leaves this rank's shard as it was, on ``device``, and training goes on with the replicas
    identical. Off CUDA only the round trip is checked. Public API and collectives only: any backend.

    Returns:
        Bytes: ``entry`` (this rank's shard of one entry), ``shard`` (of the whole state), ``full`` (the full
        state), and the growth of peak device memory in ``state_dict``, ``state_dict_to_none`` and
        ``load_state_dict`` (0 off CUDA).
    """
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).to(device)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-3), shard_state=True)
    where = next(model.parameters()).device
    cuda = where.type == "cuda"
    gen = torch.Generator().manual_seed(rank)

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 512, generator=gen).to(where)).square().mean().backward()
            opt.step()

    def growth(fn: Any) -> tuple[Any, int]:
        """``fn()`` and how far the peak of allocated device memory rose above the memory before it."""
        if not cuda:
            return fn(), 0
        torch.cuda.synchronize(where)
        torch.cuda.reset_peak_memory_stats(where)
        before = torch.cuda.memory_allocated(where)
        out = fn()
        torch.cuda.synchronize(where)
        return out, torch.cuda.max_memory_allocated(where) - before

    train(3)
    pieces = [t for g in opt.shard_optimizer.param_groups for t in g["params"]]
    state = opt.shard_optimizer.state
    mine = {
        id(t): {k: (v.device, v.detach().to("cpu", copy=True)) for k, v in state.get(t, {}).items()} for t in pieces
    }
    sizes: dict[str, int] = {}
    for t in pieces:
        for k, v in state.get(t, {}).items():
            if v.dim():
                sizes[k] = sizes.get(k, 0) + v.numel() * v.element_size()
    entry, shard = max(sizes.values()), sum(sizes.values())

    first, grown_first = growth(opt.state_dict)
    full, grown_all = growth(lambda: opt.state_dict(to=None))
    tensors = [v for entries in full["state"].values() for v in entries.values() if isinstance(v, torch.Tensor)]
    assert all(v.device.type == "cpu" for v in tensors), "the consolidated state is not on the CPU"
    if rank == 0:
        assert first is not None and first["param_groups"] == full["param_groups"]
        for i, entries in full["state"].items():
            for k, v in entries.items():
                assert first["state"][i][k].device.type == "cpu" and torch.equal(first["state"][i][k], v), (i, k)
    else:
        assert first is None, f"rank {rank}: state_dict() returned the full state off rank 0"
    total = sum(v.numel() * v.element_size() for v in tensors if v.dim())
    assert total == sum(p.numel() * p.element_size() for p in model.parameters()) * 2, (total, shard)

    _, grown_load = growth(lambda: opt.load_state_dict(full))
    for t in pieces:
        assert list(state.get(t, {})) == list(mine[id(t)]), (t.shape, list(mine[id(t)]))
        for k, v in state.get(t, {}).items():
            device, want = mine[id(t)][k]
            assert v.device == device and v.dtype == want.dtype and torch.equal(v.cpu(), want), (k, v, want)
    train(1)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().double().numpy()
    every = np.empty((size, flat.size))
    dml.allgather(backend, flat, every)
    assert (every == every[0]).all(), "the replicas differ after the round trip"

    if cuda:
        assert total > entry + SLACK, "the model is too small for the memory check to mean anything"
        for what, grown in [
            ("state_dict()", grown_first),
            ("state_dict(to=None)", grown_all),
            ("load_state_dict(full)", grown_load),
        ]:
            assert grown <= entry + SLACK, (
                f"rank {rank}: {what} raised the peak of device memory by {grown} bytes; allowed: this rank's "
                f"shard of one entry ({entry}) + {SLACK} (the full state: {total})"
            )
    return {
        "entry": entry,
        "shard": shard,
        "full": total,
        "state_dict": grown_first,
        "state_dict_to_none": grown_all,
        "load_state_dict": grown_load,
    }


# -- errors -----------------------------------------------------------------------------------------


def errors_body(backend: dml.Backend, overlap: bool) -> list[str]:
    """Errors on every rank, the world usable after each: a backward into gradients already reduced, ready
    order differing, parameters changed on one rank, a second backward after an interrupted one, ranks
    configured differently, GradScaler, and state_dict() asked of rank 0 alone inside another collective."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    x = torch.randn(2, 4, generator=_gen(3), dtype=torch.float64)
    seen: list[str] = []

    def expect(fn: Any, fragment: str, error: type[Exception] = RuntimeError) -> None:
        try:
            fn()
        except error as e:
            assert fragment in str(e), f"rank {rank}: {fragment!r} not in {e}"
            seen.append(fragment)
        else:
            raise AssertionError(f"rank {rank}: no {error.__name__} with {fragment!r}")

    model = TwoWay(0)
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=0, overlap=overlap, shard_state=True
    )

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    # 1. Accumulating into gradients already reduce-scattered (a backward after the step, without zero_grad).
    step()
    expect(lambda: model(x).sum().backward(), "already reduce-scattered")
    step()
    model.zero_grad()  # set_to_none: nothing left to add to
    model(x).sum().backward()
    opt.step()

    # 2. The last rank runs the two layers in the other order.
    if size > 1:
        opt.zero_grad()
        expect(lambda: model(x, flip=rank == size - 1).sum().backward(), "in a different order on different ranks")
    step()

    # 3. requires_grad switched on rank 0 only.
    opt.zero_grad()
    if rank == 0:
        model.c.requires_grad_(False)
    expect(lambda: model(x).sum().backward(), "the parameters changed after the sharded layout was built")
    model.c.requires_grad_(True)
    step()

    # 4. A backward interrupted midway, then another.
    opt.zero_grad()
    try:
        model(x, interrupt=True).sum().backward()
    except ValueError:
        pass
    else:
        raise AssertionError("the interrupted backward did not raise")
    expect(lambda: model(x).sum().backward(), "a second backward() started before the gradients")
    step()

    # 5. GradScaler: refused on every rank before anything moves.
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    expect(lambda: scaler.step(opt), "GradScaler is not supported", TypeError)
    step()

    # 6. state_dict() asked of rank 0 alone inside another collective (as dml.save does with what it writes).
    expect(lambda: run_on_root(backend, opt.state_dict), "Call opt.state_dict() on every rank")
    step()

    # 7. A gradient set by hand with autograd history, on each parameter in turn (others plain), reduced by step()
    # (no backward): raised where its bucket is filled, after the buckets before it went (over gloo one is left in
    # flight, completed before the error: settling it on the communication thread, which waits for the backend
    # step() holds, hung).
    for culprit in model.parameters():
        for p in model.parameters():
            p.grad = torch.ones_like(p).requires_grad_() * 2 if p is culprit else torch.ones_like(p)
        expect(opt.step, "the gradient of a parameter has autograd history")
    step()
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())

    # 8. Ranks configured differently: every rank raises at the first backward.
    other = TwoWay(1)
    odd = dml.DistributedOptimizer(
        backend, torch.optim.SGD(other.parameters(), lr=0.1), bucket_bytes=64 * (rank + 1), shard_state=True
    )
    if size > 1:
        expect(lambda: other(x).sum().backward(), "bucket_bytes is 64 on rank 0, 128 on rank 1", ValueError)
    del odd
    return seen


def zero_in_place_body(backend: dml.Backend, how: str) -> list[str]:
    """Gradients zeroed in place count as cleared: ``model.zero_grad(set_to_none=False)`` (``how="model"``) or
    ``opt.zero_grad(set_to_none=False)`` (``"opt"``) before each step's backward, every rank its own batch, with
    ``no_sync()`` micro-batches and ``clip_grad_norm_`` on some steps, trains as the unsharded optimizer. A
    backward into reduced gradients that are not all zeros still raises on every rank: after no zero_grad at
    all, after only one parameter's gradient was zeroed, after clipping (which scales them). Returns the
    messages."""
    rank = dml.local_rank(backend)
    models = [Net((5, 9, 3), 12), Net((5, 9, 3), 12)]
    opts = [
        dml.DistributedOptimizer(backend, make_optimizer("adam", m.parameters()), bucket_bytes=64, shard_state=s)
        for m, s in zip(models, (True, False), strict=True)
    ]

    def zero(model: Net, opt: Any) -> None:
        (model if how == "model" else opt).zero_grad(set_to_none=False)

    def batch(step: int, micro: int = 0) -> torch.Tensor:
        return torch.randn(3, 5, generator=_gen(100 * step + 10 * micro + rank))

    for step in range(4):
        for model, opt in zip(models, opts, strict=True):
            zero(model, opt)
            if step == 2:
                with opt.no_sync():
                    model(batch(step, 1), side=True).pow(2).mean().backward()
            model(batch(step), side=rank % 2 == 1).pow(2).mean().backward()
            opt.step()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            check_close(backend, p.detach(), q.detach(), f"step {step}: {name}", None)

    model, opt = models[0], opts[0]
    seen = []
    for spoil in ("nothing", "one", "clip"):
        zero(model, opt)
        model(batch(9)).pow(2).mean().backward()
        if spoil == "clip":
            opt.clip_grad_norm_(1e-3)  # scales the reduced gradients in place
        opt.step()
        if spoil == "one":
            model.body[0].weight.grad.zero_()  # in place, but not the others
        torch.autograd.grad(model(batch(10)).sum(), list(model.body.parameters()))  # accumulates nothing: fine
        seen.append(
            _expect(lambda: model(batch(11)).pow(2).mean().backward(), RuntimeError, "already reduce-scattered")
        )
    zero(model, opt)
    model(batch(12)).pow(2).mean().backward()
    opt.step()
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    return seen


def bad_input_body(backend: dml.Backend, culprit: int) -> int:
    """Bad arguments on rank ``culprit`` only raise there before any communication: a barrier after each
    still pairs with the other ranks' barriers."""
    rank = dml.local_rank(backend)
    model = torch.nn.Linear(3, 2)
    bad: list[tuple[Any, type[Exception], str]] = [
        (lambda: torch.optim.LBFGS(model.parameters()), TypeError, "LBFGS"),
        (lambda: torch.optim.SparseAdam(model.parameters()), TypeError, "SparseAdam"),
        (lambda: _Custom(model.parameters()), TypeError, "not known to be elementwise"),
        (lambda: Lars(model.parameters(), lr=0.1), TypeError, "a subclass of torch.optim.SGD"),
    ]
    if hasattr(torch.optim, "Adafactor"):
        bad.append((lambda: torch.optim.Adafactor(model.parameters()), TypeError, "Adafactor"))
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    bad.append((lambda: torch.optim.SGD([complex_param], lr=0.1), TypeError, "dtype torch.complex64 (shape [3])"))
    for make, error, fragment in bad:
        if rank == culprit:
            try:
                dml.DistributedOptimizer(backend, make(), shard_state=True)
            except error as e:
                assert fragment in str(e), str(e)
            else:
                raise AssertionError(f"{fragment}: accepted")
        dml.barrier(backend)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, error, fragment in [
        ({"shard_state": "yes"}, TypeError, "shard_state"),
        ({"shard_state": True, "backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
        ({"shard_state": True, "communication_dtype": torch.int8}, ValueError, "communication_dtype"),
        ({"shard_state": True, "bucket_bytes": -1}, ValueError, "bucket_bytes"),
        ({"shard_state": True, "op": "bogus"}, ValueError, "bogus"),
    ]:
        if rank == culprit:
            try:
                dml.DistributedOptimizer(backend, sgd, **kwargs)
            except error as e:
                assert fragment in str(e), str(e)
            else:
                raise AssertionError(f"{kwargs}: accepted")
        dml.barrier(backend)
    return rank


class _Custom(torch.optim.Optimizer):
    """An optimizer the sharded optimizer cannot know to be elementwise."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})


class Lars(torch.optim.SGD):
    """SGD scaled per parameter by LARS's trust ratio ``||w|| / ||grad||``: norms over each whole parameter, which
    on a 1-D piece of a flat buffer would be the norms of the piece (wrong steps, no error)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.add_(p.grad * trust, alpha=-group["lr"])
        return None


class SignSGD(torch.optim.SGD):
    """A subclass that is elementwise (each element steps by the sign of its gradient): accepted once registered."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
        return None


class SignSGDChild(SignSGD):
    """A subclass of a registered class: not registered itself, so refused."""


def elementwise_body(backend: dml.Backend) -> list[str]:
    """Only the exact classes known to be elementwise are sharded. A subclass of one (LARS's per-tensor trust
    ratio) is refused on every rank with a ``TypeError`` that says why and what to do, as is an unregistered
    subclass of a registered class and ``differentiable=True``; the eleven torch classes are accepted; a
    subclass registered with ``dml.ShardedOptimizer.register_elementwise`` trains as the unsharded optimizer
    (each rank its own batch). Returns the messages."""
    rank = dml.local_rank(backend)
    seen: list[str] = []
    assert dml.ShardedOptimizer.register_elementwise(SignSGD) is SignSGD  # a decorator too; again: no change
    assert dml.ShardedOptimizer.register_elementwise(SignSGD) is SignSGD
    model = Net((5, 9, 3), 8)
    refused: list[tuple[Any, list[str]]] = [
        (
            lambda: Lars(model.parameters(), lr=0.1),
            [
                "got Lars, a subclass of torch.optim.SGD",
                "per-tensor",
                "shard_state=False",
                "register_elementwise(Lars)",
            ],
        ),
        (lambda: SignSGDChild(model.parameters(), lr=0.1), ["got SignSGDChild, a subclass of SignSGD"]),
        (lambda: _Custom(model.parameters()), ["got _Custom", "shard_state=False", "register_elementwise(_Custom)"]),
        (lambda: torch.optim.Adam(model.parameters(), differentiable=True), ["differentiable=True", "False"]),
    ]
    for make, fragments in refused:
        try:
            dml.DistributedOptimizer(backend, make(), shard_state=True)
        except TypeError as e:
            assert all(f in str(e) for f in fragments), f"rank {rank}: {fragments} not all in {e}"
            seen.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: accepted {type(make()).__qualname__}: {fragments[0]}")
    for kind in KINDS:  # the exact classes
        dml.DistributedOptimizer(backend, make_optimizer(kind, Net((5, 9, 3), 8).parameters()), shard_state=True)
    for bad, fragment in [
        (torch.optim.SGD(model.parameters(), lr=0.1), "got an instance of SGD"),
        (int, "got int"),
        (type("LbfgsChild", (torch.optim.LBFGS,), {}), "LBFGS"),
    ]:
        seen.append(_expect(lambda bad=bad: dml.ShardedOptimizer.register_elementwise(bad), TypeError, fragment))
    models = [Net((5, 9, 3), 8), Net((5, 9, 3), 8)]
    opts = [
        dml.DistributedOptimizer(backend, SignSGD(m.parameters(), lr=0.01), bucket_bytes=64, shard_state=s)
        for m, s in zip(models, (True, False), strict=True)
    ]
    for step in range(3):
        for model_, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            model_(torch.randn(3, 5, generator=_gen(10 * step + rank)), side=True).pow(2).mean().backward()
            opt.step()
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            check_close(backend, p.detach(), q.detach(), f"SignSGD, step {step}", None)
    added = {"params": [torch.nn.Parameter(torch.ones(2))], "differentiable": True}
    fragment = "the added parameter group has differentiable=True"
    seen.append(_expect(lambda: opts[0].add_param_group(added), TypeError, fragment))  # before communicating
    return seen


# -- memory, clipping, special parameters ---------------------------------------------------------------


def memory_body(backend: dml.Backend, widths: tuple[int, ...]) -> dict[str, int]:
    """Adam's state per rank is this rank's W-th of the elements (every element on exactly one rank);
    the parameters and gradients live in one flat buffer each; the wrapped optimizer keeps no state."""
    size = dml.total_workers(backend)
    model = Net(widths, 3)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), bucket_bytes=1024, shard_state=True)
    opt.zero_grad()
    model(torch.randn(2, widths[0]), side=True).sum().backward()
    model.never.grad = torch.ones(3)  # by hand: every parameter has state after the step
    opt.step()
    total = sum(p.numel() for p in model.parameters())
    state = opt.shard_optimizer.state
    mine = sum(v.numel() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    owned = sum(pc.hi - pc.lo for pc in opt._pieces)
    assert mine == 2 * owned, (mine, owned)  # exp_avg and exp_avg_sq of the owned elements, nothing else
    every = np.empty(size, dtype=np.int64)
    dml.allgather(backend, np.array(owned, dtype=np.int64), every)
    assert every.sum() == total, (every, total)  # each element on exactly one rank
    buckets, shard = len(opt._buckets), sum(f.shard for f in opt._flats)  # the shard: the same size on every rank
    assert every.max() <= shard, (every, shard)
    # Padding: each parameter starts on 64 bytes (< 16 float32 gaps), each bucket rounds up to a multiple of W.
    padding = shard * size - total
    assert 0 <= padding <= 15 * len(opt._params) + (size - 1) * buckets, (padding, total, buckets)
    assert not opt.state and not opt.optimizer.state, "the wrapped optimizer holds no state of its own"
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    assert len(storages) == 1 and len(grads) == 1, (storages, grads)
    return {"owned": owned, "total": total, "buckets": buckets}


def clip_body(backend: dml.Backend, norm_type: float, replace: bool = False) -> float:
    """``opt.clip_grad_norm_`` equals torch's clip_grad_norm_ on the unsharded gradients (norm and parameters);
    ``replace``: each ``.grad`` replaced after backward (``p.grad = p.grad.clamp(...)``), which both must measure."""
    rank = dml.local_rank(backend)
    models = [Net((5, 8, 2), 4), Net((5, 8, 2), 4)]
    opts = [
        dml.DistributedOptimizer(backend, torch.optim.SGD(m.parameters(), lr=0.5), bucket_bytes=64, shard_state=s)
        for m, s in zip(models, (True, False), strict=True)
    ]
    x = torch.randn(4, 5, generator=_gen(rank)) * (rank + 1) * 3
    norms = []
    for model, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        model(x, side=True).pow(2).sum().backward()
        if replace:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.clamp(-2.0, 2.0)
    norms.append(float(opts[0].clip_grad_norm_(0.5, norm_type)))
    norms.append(float(torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5, norm_type)))
    assert norms[1] > 0.5, "the case must clip"
    np.testing.assert_allclose(norms[0], norms[1], rtol=1e-5)
    for opt in opts:
        opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    return norms[0]


@dataclass(frozen=True)
class ClipCase:
    seed: int
    shapes: tuple[tuple[int, ...], ...]
    float64: int  # the index of a float64 parameter (the others float32), or -1
    unused: int  # the index of a parameter without gradient on odd ranks (on every rank if unused_everywhere), or -1
    unused_everywhere: bool
    norm_type: float
    max_norm: float
    scale: float  # of the gradients
    specials: tuple[tuple[int, int, int, float], ...]  # (rank, parameter, element, value) put into that gradient
    error_if_nonfinite: bool
    foreach: bool | None
    bucket_bytes: int
    overlap: bool


@st.composite
def clip_cases(draw: st.DrawFn) -> ClipCase:
    shapes = tuple(draw(st.lists(st.sampled_from([(1,), (7,), (3, 5), (2, 3, 2), (17,)]), min_size=1, max_size=4)))
    n = len(shapes)
    special = st.tuples(
        st.integers(0, 3),
        st.integers(0, n - 1),
        st.integers(0, 100),
        st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    )
    return ClipCase(
        seed=draw(st.integers(0, 10**6)),
        shapes=shapes,
        float64=draw(st.integers(-1, n - 1)),
        unused=draw(st.integers(-1, n - 1)) if n > 1 else -1,  # every rank runs a backward
        unused_everywhere=draw(st.booleans()),
        norm_type=draw(st.sampled_from([2.0, 1.0, float("inf"), 3.0, 0.5])),
        max_norm=draw(st.sampled_from([1e-3, 0.5, 5.0, 1e6])),
        scale=draw(st.sampled_from([1e-3, 1.0, 100.0])),
        specials=tuple(draw(st.lists(special, max_size=3))),
        error_if_nonfinite=draw(st.booleans()),
        foreach=draw(st.sampled_from([None, True, False])),
        bucket_bytes=draw(st.sampled_from([0, 32, 1 << 20])),
        overlap=draw(st.booleans()),
    )


def _clip_params(case: ClipCase) -> list[torch.nn.Parameter]:
    g = _gen(case.seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64 if i == case.float64 else torch.float32))
        for i, s in enumerate(case.shapes)
    ]


def _clip_backward(backend: dml.Backend, case: ClipCase, params: list[torch.nn.Parameter]) -> None:
    """A backward whose gradient of each parameter is this rank's own random tensor, with the case's NaN and
    inf entries (so the averaged gradient has them, or NaN where +inf and -inf meet)."""
    rank = dml.local_rank(backend)
    g = _gen(case.seed + 1 + rank)
    loss = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(params):
        if i == case.unused and (case.unused_everywhere or rank % 2 == 1):
            continue
        c = torch.randn(p.shape, generator=g, dtype=p.dtype) * case.scale
        for r, k, at, value in case.specials:
            if r == rank and k == i:
                c.view(-1)[at % c.numel()] = value
        loss = loss + (p * c).sum()
    loss.backward()


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to rounding, NaN where NaN, inf where inf (the norm and the clipped gradients)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _shard_is(opts: list[Any]) -> None:
    """This rank's shard of the sharded gradients is the unsharded ``.grad`` (``_same``); None in the same places."""
    ours, ref = ([p for g in opt.param_groups for p in g["params"]] for opt in opts)
    for p, q in zip(ours, ref, strict=True):
        assert (p.grad is None) == (q.grad is None), (p.shape, p.grad, q.grad)
    for pc in opts[0]._pieces:
        q = ref[pc.index]
        if q.grad is not None and pc.grad is not None:
            _same(pc.grad.reshape(-1), q.grad.reshape(-1)[pc.lo : pc.hi], f"gradient of parameter {pc.index}")


def clip_property_body(backend: dml.Backend, case: ClipCase) -> str:
    """``opt.clip_grad_norm_`` is ``torch.nn.utils.clip_grad_norm_`` on the unsharded optimizer's (averaged)
    gradients: the same norm (value, NaN or inf; dtype; the gradients' device), this rank's shard of the clipped
    gradients and the parameters after a step, for p-norms 1, 2, inf, 3 and 0.5 with NaN and inf entries; with
    ``error_if_nonfinite=True`` and a non-finite norm torch's ``RuntimeError`` on every rank, gradients
    unchanged. Returns what happened ("raised", or the norm)."""
    size = dml.total_workers(backend)
    params = [_clip_params(case), _clip_params(case)]
    opts = [
        dml.DistributedOptimizer(
            backend,
            torch.optim.SGD(ps, lr=0.1),
            bucket_bytes=case.bucket_bytes,
            overlap=case.overlap,
            shard_state=s,
        )
        for ps, s in zip(params, (True, False), strict=True)
    ]
    for ps, opt in zip(params, opts, strict=True):
        opt.zero_grad()
        _clip_backward(backend, case, ps)
    kwargs = {"error_if_nonfinite": case.error_if_nonfinite, "foreach": case.foreach}
    results: list[Any] = []
    for clip in (
        lambda: opts[0].clip_grad_norm_(case.max_norm, case.norm_type, **kwargs),
        lambda: torch.nn.utils.clip_grad_norm_(params[1], case.max_norm, case.norm_type, **kwargs),
    ):
        try:
            results.append(clip())
        except RuntimeError as e:
            results.append(str(e))
    got, want = results
    _shard_is(opts)  # after clipping (or raising): this rank's shard of the gradients is torch's
    every = dml.allgather_object(backend, got if isinstance(got, str) else "returned")
    if isinstance(want, str):
        assert got == want, f"torch raised {want!r}; clip_grad_norm_ gave {got!r}"
        assert every == [want] * size, every  # on every rank
        return "raised"
    assert not isinstance(got, str), got
    assert every == ["returned"] * size, every
    assert (got.dtype, got.device) == (want.dtype, want.device), (got, want)
    _same(got, want, "the norm")
    for opt in opts:
        opt.step()
    for p, q in zip(*params, strict=True):
        _same(p.detach(), q.detach(), "parameters after the step")
    return str(float(got))


def clip_no_sync_body(backend: dml.Backend) -> str:
    """Inside ``no_sync()`` (the gradient buffer mixes reduced and local parts) ``clip_grad_norm_`` raises
    ``RuntimeError`` on every rank and changes nothing; outside it, it reduces what ``no_sync()`` accumulated
    first (as ``step()`` would) and clips as torch does the unsharded gradients after ``synchronize()``."""
    case = ClipCase(3, ((5, 3), (7,)), -1, -1, False, 2.0, 0.1, 1.0, (), False, None, 32, False)
    params = [_clip_params(case), _clip_params(case)]
    opts = [
        dml.DistributedOptimizer(backend, torch.optim.SGD(ps, lr=0.1), bucket_bytes=32, shard_state=s)
        for ps, s in zip(params, (True, False), strict=True)
    ]
    for ps, opt in zip(params, opts, strict=True):
        opt.zero_grad()
        with opt.no_sync():
            _clip_backward(backend, case, ps)
            _clip_backward(backend, case, ps)
            if opt is opts[0]:
                before = [p.grad.clone() for p in ps]
                message = _expect(lambda: opts[0].clip_grad_norm_(0.1), RuntimeError, "inside opt.no_sync()")
                for p, b in zip(ps, before, strict=True):
                    assert torch.equal(p.grad, b), "clip_grad_norm_ inside no_sync() changed the gradients"
    assert dml.allgather_object(backend, message) == [message] * dml.total_workers(backend)
    opts[1].synchronize()
    want = torch.nn.utils.clip_grad_norm_(params[1], 0.1)
    got = opts[0].clip_grad_norm_(0.1)
    _same(got, want, "the norm")
    _shard_is(opts)
    for opt in opts:
        opt.step()
    for p, q in zip(*params, strict=True):
        _same(p.detach(), q.detach(), "parameters after the step")
    return message


class Mixed(torch.nn.Module):
    """float32 and float64 parameters, a parameter without elements and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        g = _gen(9)
        self.a = torch.nn.Parameter(torch.randn(5, 3, generator=g))
        self.empty = torch.nn.Parameter(torch.empty(0, 3))
        self.frozen = torch.nn.Parameter(torch.randn(3, generator=g), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(3, 2, generator=g, dtype=torch.float64))
        self.scalar = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.a + self.frozen + self.empty.sum())
        return (h.double() @ self.b) * self.scalar


def special_parameters_body(backend: dml.Backend, kind: str, step_during_backward: bool = False) -> None:
    """Two dtypes (two flat buffers), a 0-d, an empty and a frozen parameter: as unsharded, state_dict included;
    then add_param_group, after which both go on alike (``step_during_backward``: the sharded one steps its buckets
    during backward, and rank 0 alone steps the empty parameter at its end: every rank makes the same collectives)."""
    rank = dml.local_rank(backend)
    models = [Mixed(), Mixed()]
    extra = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))]
    opts = [
        dml.DistributedOptimizer(
            backend,
            make_optimizer(kind, m.parameters()),
            bucket_bytes=32,
            shard_state=s,
            step_during_backward=step_during_backward and s,
        )
        for m, s in zip(models, (True, False), strict=True)
    ]
    for step in range(4):
        if step == 2:
            for opt, e in zip(opts, extra, strict=True):
                opt.add_param_group({"params": [e], "lr": 0.05})
        x = torch.randn(2, 5, generator=_gen(10 * step + rank))
        for model, opt, e in zip(models, opts, extra, strict=True):
            opt.zero_grad()
            (model(x).sum() + (e * x.sum()).sum()).backward()
            opt.step()
        for p, q in zip([*models[0].parameters(), extra[0]], [*models[1].parameters(), extra[1]], strict=True):
            check_close(backend, p.detach(), q.detach(), f"step {step}", None)
    consolidated_equal(backend, opts[0], opts[1], None)


def synchronize_body(backend: dml.Backend) -> None:
    """dml.synchronize(backend, opt) makes the hyper-parameters rank 0's; the state stays sharded."""
    rank = dml.local_rank(backend)
    model = dml.synchronize(backend, Net((3, 4, 2), rank))  # different initial weights: rank 0's everywhere
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    opt = dml.synchronize(backend, dml.DistributedOptimizer(backend, sgd, shard_state=True))
    assert all(g["lr"] == 0.1 for g in opt.param_groups), opt.param_groups
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(2, 3, generator=_gen(step + 10 * rank))).sum().backward()
        opt.step()
    assert all(g["lr"] == 0.1 for g in opt.shard_optimizer.param_groups)
    replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())


#: Named variants of ``fixed_case``: each path on its own, for SGD-momentum and Adam.
VARIANTS: dict[str, dict[str, Any]] = {
    "end_of_backward": {},
    "overlap": {"overlap": True},
    "no_sync": {"accumulate": "no_sync", "micro": 3},
    "backward_passes_per_step": {"accumulate": "passes", "micro": 3},
    "unused_on_some_ranks": {"unused": "some"},
    "unused_everywhere": {"unused": "all"},
    "bfloat16": {"wire": "bfloat16"},
    "bfloat16_overlap": {"wire": "bfloat16", "overlap": True},
    "sum": {"op": "sum", "micro": 1},
    "synchronize": {"synchronize": True},
    "one_group_no_scheduler": {"scheduler": False, "groups": False},
    "every_parameter_a_bucket": {"bucket_bytes": 0},
    "one_bucket": {"bucket_bytes": 1 << 20},
}


def extras_body(backend: dml.Backend) -> None:
    """As unsharded: sparse embedding gradients (dense in the buffer), step(closure) with its reduced loss,
    gradients set by hand and reduced by synchronize(), and an optimizer whose parameters are all frozen."""
    rank = dml.local_rank(backend)
    results: list[list[torch.Tensor]] = []
    for sharded in (True, False):
        emb = torch.nn.Embedding(10, 3, sparse=True)
        lin = torch.nn.Linear(4, 1)
        hand = torch.nn.Parameter(torch.zeros(5))
        for p in [*emb.parameters(), *lin.parameters()]:
            p.data.copy_(torch.randn(p.shape, generator=_gen(p.numel())))
        opts = [
            dml.DistributedOptimizer(  # Adam takes dense gradients: the unsharded form densifies them as asked
                backend, torch.optim.Adam(emb.parameters(), lr=0.1), shard_state=sharded, sparse_as_dense=True
            ),
            dml.DistributedOptimizer(backend, make_optimizer("sgd", lin.parameters()), shard_state=sharded),
            dml.DistributedOptimizer(backend, torch.optim.SGD([hand], lr=1.0), shard_state=sharded),
        ]
        x = torch.randn(8, 4, generator=_gen(rank))
        losses = []
        for k in range(3):
            opts[0].zero_grad(set_to_none=k != 1)  # a zeroed buffer once: sparse gradients added into it
            emb(torch.tensor([rank, 5])).sum().backward()
            opts[0].step()

            def closure() -> torch.Tensor:
                opts[1].zero_grad()
                loss = lin(x).pow(2).mean()
                loss.backward()
                return loss

            losses.append(opts[1].step(closure))
            opts[2].zero_grad()
            if rank % 2 == 0:
                hand.grad = torch.full((5,), float(rank + k))  # by hand on even ranks only
            opts[2].synchronize()
            opts[2].step()
        results.append([emb.weight.detach().clone(), lin.weight.detach().clone(), hand.detach().clone(), *losses])
        frozen = torch.nn.Linear(3, 2).requires_grad_(False)
        opt = dml.DistributedOptimizer(backend, torch.optim.Adam(frozen.parameters()), shard_state=sharded)
        opt.zero_grad()
        opt.step()
        state = opt.state_dict()
        assert state is None if sharded and rank > 0 else state["state"] == {}, state
    for got, want in zip(*results, strict=True):
        check_close(backend, got, want, "extras", None)


def ring_body(backend: dml.Backend) -> bool:
    """Under ``DML_TRANSPORT=gloo`` the buckets, the header and the allgathers go over gloo, on by default
    with overlap, and training equals the unsharded optimizer's (whose buckets take the ring too)."""
    model = Net((6, 20, 3), 2)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)
    opt.zero_grad()
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert opt._ring is not None and opt.overlap, (opt._ring, opt.overlap)
    ring, before = opt._ring, dict(opt._ring.calls)
    assert before["reduce_scatter"] > 0 and before["allgather"] > 0, f"the step did not go over the ring: {before}"
    for kind in ("sgd", "adam"):
        equivalence_body(backend, fixed_case(kind, overlap=True, micro=1))
        equivalence_body(backend, fixed_case(kind, wire="bfloat16", unused="all"))  # halves: over MPI
    ran = {k: ring.calls[k] - before[k] for k in before}
    assert all(ran.values()), f"the equivalence runs did not all take the ring: {ran}"
    return True


class Tied(torch.nn.Module):
    """An embedding whose weight the output projection reuses, a parameter of the root used in its own forward,
    and an MLP between: what prefetch's per-module waits must cover."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: the head's forward uses the embedding's parameter
        self.scale = torch.nn.Parameter(torch.ones(8))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(tokens)) * self.scale)


class _SelfAttention(torch.nn.Module):
    """torch's attention, whose forward hands ``out_proj``'s parameters to a function without calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, x, x, need_weights=False)[0]


def attending(seed: int) -> torch.nn.Sequential:
    """An embedding, an attention block and an MLP head, in an ``nn.Sequential`` (each waits for its own bucket)."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 8), _SelfAttention(), torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 11)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def prefetch_body(backend: dml.Backend, delay: float, kind: str = "tied") -> int:
    """prefetch=True (across hosts: gloo with overlap) against prefetch=False and the unsharded optimizer: the same
    losses at every step (a forward that read a parameter before its allgather arrived would differ; the
    transport's allgathers are slowed by ``delay`` s to make that likely) and the same parameters at the end. The
    optimizer left its forward pre-hook in place after step() (prefetch was in effect), and ``opt.zero_grad()``
    before each forward no longer waits for the allgathers, so the forward runs while they are in flight.
    ``kind``: :class:`Tied`, or :func:`attending` (``nn.MultiheadAttention`` reads ``out_proj``'s parameters
    without calling it: waiting for its own parameters only, they were stale)."""
    from distutils_ml.transport import transport_for

    ring = transport_for(backend)
    assert ring is not None, "prefetch_body runs over gloo"
    slow_allgather = ring.allgather
    if delay:

        def allgather(*args: Any, **kwargs: Any) -> None:
            import time

            time.sleep(delay)
            slow_allgather(*args, **kwargs)

        ring.allgather = allgather  # type: ignore[method-assign]
    try:
        models = [Tied(3) if kind == "tied" else attending(3) for _ in range(3)]

        def inner(model: torch.nn.Module) -> torch.optim.Optimizer:  # attention's key bias has no gradient but
            if kind == "tied":  # rounding, which Adam would make a full step of
                return torch.optim.Adam(model.parameters(), lr=0.05)
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        opts = [
            dml.DistributedOptimizer(backend, inner(models[0]), shard_state=True, prefetch=True, bucket_bytes=1024),
            dml.DistributedOptimizer(backend, inner(models[1]), shard_state=True, bucket_bytes=1024),
            dml.DistributedOptimizer(backend, inner(models[2]), bucket_bytes=1024),
        ]
        assert opts[0].overlap, "prefetch_body needs overlap (the default across hosts, DML_OVERLAP=1 here)"
        gen = torch.Generator().manual_seed(17 + backend.rank)
        batches = [torch.randint(0, 11, (6,), generator=gen) for _ in range(4)]
        deferred = 0
        losses: list[list[float]] = [[], [], []]
        in_flight = 0
        for model, opt, seen in zip(models, opts, losses, strict=True):  # one model at a time: nothing else waits
            for tokens in batches:
                opt.zero_grad()
                in_flight += opt is opts[0] and bool(opt._arriving)
                logits = model(tokens.view(2, 3)).reshape(6, 11) if kind != "tied" else model(tokens)
                loss = torch.nn.functional.cross_entropy(logits, tokens)
                loss.backward()
                opt.step()
                deferred += opt is opts[0] and opt._arrival_hook is not None
                seen.append(loss.item())
        assert losses[0] == losses[1], f"losses with prefetch {losses[0]}, without {losses[1]}"
        if exact(backend):
            assert losses[1] == losses[2], f"losses sharded {losses[1]}, unsharded {losses[2]}"
        opts[0].wait_for_parameters()
        assert opts[0]._arrival_hook is None and not opts[0]._arriving
        for p, q, r in zip(*(m.parameters() for m in models), strict=True):
            assert torch.equal(p, q), (p - q).abs().max()
            check_close(backend, p.detach(), r.detach(), "prefetch against the unsharded optimizer", None)
        assert deferred == 4, f"step() waited for its allgathers in {4 - deferred} of 4 steps"
        if delay:
            assert in_flight == 3, f"zero_grad() waited for the allgathers before {3 - in_flight} of 3 forwards"
        replicas_identical(backend, torch.cat([p.detach().reshape(-1) for p in models[0].parameters()]).tolist())
        return deferred
    finally:
        if delay:
            ring.allgather = slow_allgather  # type: ignore[method-assign]
