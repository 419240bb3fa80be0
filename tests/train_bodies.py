"""Bodies for synchronize and DistributedOptimizer, run on LocalBackend and under MPI.

Each rank can rebuild every rank's data from the case, so expected values (root's
tree, big-batch training on one model) are computed locally.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import distutils_ml as dml

Pair = collections.namedtuple("Pair", "tensor number")


@dataclass
class Holder:
    """A dataclass leaf container."""

    array: np.ndarray
    label: str


@dataclass(frozen=True)
class Frozen:
    value: Any


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_model(seed: int, hidden: int = 16, bn: bool = True) -> torch.nn.Module:
    """A small MLP (with BatchNorm) whose weights depend only on ``seed``."""
    layers: list[torch.nn.Module] = [torch.nn.Linear(3, hidden), torch.nn.Tanh()]
    if bn:
        layers.append(torch.nn.BatchNorm1d(hidden))
    layers.append(torch.nn.Linear(hidden, 2))
    model = torch.nn.Sequential(*layers)
    g = _gen(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def make_tree(rank: int, seed: int) -> dict[str, Any]:
    """A nested value with every leaf kind, different on every rank."""
    g = _gen(seed * 100 + rank)
    model = make_model(seed + rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.9, 0.99 - 0.01 * rank))
    if rank % 2 == 1:  # odd ranks have stepped: their optimizer state exists, even ranks' does not
        model(torch.randn(4, 3, generator=g)).sum().backward()
        opt.step()
    model.train()(torch.randn(5, 3, generator=g))  # moves BatchNorm running statistics
    return {
        "model": model,
        "opt": opt,
        "t32": torch.randn(3, 2, generator=g),
        "t16": torch.randn(4, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 100, (2, 2), generator=g),
        "np": np.full((2, 3), float(rank)),
        "scalar": torch.tensor(rank * 1.5),
        "int": rank,
        "float": rank / 3,
        "str": f"rank {rank}",
        "none": None if rank == 0 else [rank],
        "tuple": (rank, torch.full((2,), float(rank))),
        "list": [torch.arange(3) + rank, {"deep": rank}],
        "pair": Pair(torch.full((1,), float(rank)), rank),
        "holder": Holder(np.arange(4) * rank, f"h{rank}"),
        "frozen": Frozen(torch.ones(2) * rank),
        "empty": torch.empty(0),
    }


def _flat(tree: Any) -> list[Any]:
    """Comparable leaves of a tree (modules and optimizers expanded)."""
    if isinstance(tree, torch.nn.Module):
        return [t.detach().clone() for t in tree.state_dict().values()]
    if isinstance(tree, torch.optim.Optimizer):
        sd = tree.state_dict()
        return [repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in sd["param_groups"]] + [
            (i, k, v.clone() if isinstance(v, torch.Tensor) else v)
            for i, s in sorted(sd["state"].items())
            for k, v in sorted(s.items())
        ]
    if isinstance(tree, dict):
        return [(k, x) for k in sorted(tree) for x in _flat(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [type(tree).__name__] + [x for v in tree for x in _flat(v)]
    if dataclasses.is_dataclass(tree):
        return [type(tree).__name__] + [x for f in dataclasses.fields(tree) for x in _flat(getattr(tree, f.name))]
    return [tree]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@st.composite
def sync_cases(draw: st.DrawFn) -> tuple[int, int]:
    return draw(st.integers(0, 63)), draw(st.integers(0, 1000))


def synchronize_body(backend: dml.Backend, case: tuple[int, int]) -> None:
    """Every leaf kind ends as root's (root != 0 drawn too), types and identities kept;
    a structure that differs on one rank is a ValueError on every rank."""
    root_draw, seed = case
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    root = root_draw % size
    mine = make_tree(rank, seed)
    model, t32 = mine["model"], mine["t32"]
    out = dml.synchronize(backend, mine, root=root)
    assert out["model"] is model and out["t32"] is t32, "arrays and modules are synchronized in place"
    assert type(out["pair"]) is Pair and type(out["holder"]) is Holder and type(out["frozen"]) is Frozen
    expected = _flat(make_tree(root, seed))
    got = _flat(out)
    assert len(got) == len(expected), (len(got), len(expected))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert _equal(g, e), f"rank {rank}, root {root}: leaf {i}: {g!r} != {e!r}"
    if size > 1:  # then a structure that differs on one rank raises on every rank
        odd, kind = seed % size, seed % 4
        try:
            dml.synchronize(backend, make_mismatched(rank, odd, kind), root=root)
        except ValueError as e:
            assert "hold a structure that differs" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}, root {root}: no error for mismatch {kind} on rank {odd}")


def make_mismatched(rank: int, odd: int, kind: int) -> Any:
    """A value whose structure on rank ``odd`` differs from the other ranks' (dict keys, list
    vs tuple, namedtuple vs tuple, optimizer parameter count, by ``kind``)."""
    t = torch.full((2,), float(rank))
    differs = rank == odd
    if kind == 0:
        return {"a": t, ("c" if differs else "b"): rank}
    if kind == 1:
        return {"v": (t, rank) if differs else [t, rank]}
    if kind == 2:
        return {"p": (t, rank) if differs else Pair(t, rank)}
    params = list(make_model(rank, bn=False).parameters())
    return torch.optim.Adam(params[: len(params) - differs], lr=0.1)


# -- training -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainCase:
    optimizer: str  # "sgd" (momentum) or "adam"
    steps: int
    batch: int  # per rank
    seed: int
    bucket_bytes: int


@st.composite
def train_cases(draw: st.DrawFn) -> TrainCase:
    return TrainCase(
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        steps=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 10_000)),
        bucket_bytes=draw(st.sampled_from([0, 256, 1 << 20])),  # all in place / mixed / all bucketed
    )


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _data(case: TrainCase, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(case.seed + 7)
    n = case.batch * size * case.steps
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


class AllreduceThenStep:
    """A plain optimizer whose gradients ``allreduce_gradients`` averages before each step."""

    def __init__(self, backend: dml.Backend, model: torch.nn.Module, opt: torch.optim.Optimizer, bucket_bytes: int):
        self.backend, self.model, self.opt, self.bucket_bytes = backend, model, opt, bucket_bytes

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        dml.allreduce_gradients(self.backend, self.model, bucket_bytes=self.bucket_bytes)
        self.opt.step()


def train_body(backend: dml.Backend, case: TrainCase, wrapped: bool = True, overlap: bool | None = None) -> list[float]:
    """k steps on W ranks (each its shard, mean loss) == k steps of one model on the global batch.

    ``wrapped``: through DistributedOptimizer; else allreduce_gradients before a plain optimizer's step.
    """
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    x, y = _data(case, size)
    model = make_model(case.seed if rank == 0 else case.seed + 1, bn=False).double()
    model = dml.synchronize(backend, model)
    plain = _optimizer(case.optimizer, model.parameters())
    if wrapped:
        opt: Any = dml.DistributedOptimizer(backend, plain, bucket_bytes=case.bucket_bytes, overlap=overlap)
    else:
        opt = AllreduceThenStep(backend, model, plain, case.bucket_bytes)
    ref = make_model(case.seed, bn=False).double()
    ref_opt = _optimizer(case.optimizer, ref.parameters())
    gb = case.batch * size
    for k in range(case.steps):
        xs, ys = x[k * gb : (k + 1) * gb], y[k * gb : (k + 1) * gb]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[rank::size]), ys[rank::size]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-9, atol=1e-9, err_msg=str(case))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def replicas_identical(backend: dml.Backend, values: list[float]) -> bool:
    """Every rank holds bitwise the same ``values`` (checked with an allgather)."""
    mine = np.asarray(values, dtype=np.float64)
    every = np.empty((dml.total_workers(backend), mine.size))
    dml.allgather(backend, mine, every)
    assert (every == every[0]).all(), f"replicas differ by up to {np.abs(every - every[0]).max()}"
    return True


def train_identical_body(backend: dml.Backend, case: TrainCase) -> None:
    """train_body, and the replicas end bitwise identical."""
    replicas_identical(backend, train_body(backend, case))


def train_overlap_body(backend: dml.Backend, case: TrainCase) -> None:
    """train_identical_body with the buckets reduced on the communication thread during backward."""
    replicas_identical(backend, train_body(backend, case, overlap=True))


def gradients_body(backend: dml.Backend, case: TrainCase) -> None:
    """train_identical_body with allreduce_gradients and a plain optimizer instead of DistributedOptimizer."""
    replicas_identical(backend, train_body(backend, case, wrapped=False))


class TwoBranch(torch.nn.Module):
    """A model whose second branch is used only on odd ranks, and a third never."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = _gen(seed)
        self.a = torch.nn.Parameter(torch.randn(4, 2, generator=g))
        self.b = torch.nn.Parameter(torch.randn(4, 2, generator=g))
        self.unused = torch.nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = x @ self.a
        return out + x @ self.b if use_b else out


def unused_parameters_body(backend: dml.Backend, seed: int, overlap: bool | None = None) -> list[float]:
    """A parameter unused on some ranks counts as zeros there; unused everywhere stays None."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    x = torch.randn(size, 4, generator=g)
    for bucket_bytes in (0, 1 << 20):
        model = TwoBranch(seed)
        opt = dml.DistributedOptimizer(
            backend, torch.optim.SGD(model.parameters(), lr=0.5), bucket_bytes=bucket_bytes, overlap=overlap
        )
        opt.zero_grad()
        model(x[rank : rank + 1], use_b=rank % 2 == 1).sum().backward()
        opt.step()
        assert model.unused.grad is None, "a parameter without gradient on every rank keeps None"
        ga = sum(x[r] for r in range(size)).unsqueeze(1).expand(4, 2) / size
        gb = sum(x[r] for r in range(size) if r % 2 == 1)
        gb = torch.zeros(4, 2) if isinstance(gb, int) else gb.unsqueeze(1).expand(4, 2) / size
        torch.testing.assert_close(model.a.grad, ga)
        if size > 1:
            torch.testing.assert_close(model.b.grad, gb)
    return model.b.detach().reshape(-1).tolist()


def accumulation_body(backend: dml.Backend, seed: int) -> None:
    """Accumulating micro-batches reduces their sum once: no_sync then a reducing backward (DDP), all inside
    no_sync then synchronize() or step(), backward_passes_per_step (Horovod); op=SUM shows a double reduction,
    and a second reducing backward under SUM is refused."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    xs = torch.randn(2, size, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(2, size, 2, generator=g, dtype=torch.float64)
    # Reference: SGD on the SUM over ranks of both micro-batch gradients (op=SUM detects a double reduction).
    ref = make_model(seed, bn=False).double()
    for m in range(2):
        for r in range(size):
            torch.nn.functional.mse_loss(ref(xs[m, r : r + 1]), ys[m, r : r + 1]).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)

    def backward(m: int) -> None:
        torch.nn.functional.mse_loss(model(xs[m, rank : rank + 1]), ys[m, rank : rank + 1]).backward()

    for style in ("no_sync", "synchronize", "no_sync_step", "passes", "twice"):
        model = make_model(seed, bn=False).double()
        passes = 2 if style == "passes" else 1
        opt = dml.DistributedOptimizer(
            backend, torch.optim.SGD(model.parameters(), lr=0.1), op=dml.SUM, backward_passes_per_step=passes
        )
        opt.zero_grad()
        if style == "no_sync":  # DDP's way: the last backward, outside, reduces the sum
            with opt.no_sync():
                backward(0)
            backward(1)
            opt.step()
        elif style in ("synchronize", "no_sync_step"):  # all inside; synchronize() or step() reduces
            with opt.no_sync():
                backward(0)
                backward(1)
            if style == "synchronize":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
        elif style == "passes":  # Horovod's backward_passes_per_step
            backward(0)
            backward(1)
            opt.step()
        else:  # a second reducing backward under SUM would count the first one W times: every rank refuses
            backward(0)
            try:
                backward(1)
            except RuntimeError as e:
                assert "a second backward() since the last step" in str(e), str(e)
            else:
                raise AssertionError("no error for a second reducing backward under SUM")
            continue
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=style)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=style)


def compression_body(backend: dml.Backend, seed: int) -> None:
    """communication_dtype=bfloat16 averages to bfloat16 precision and keeps replicas identical."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    grads = torch.randn(size, 5, 7, generator=g)
    p = torch.nn.Parameter(torch.zeros(5, 7))
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD([p], lr=1.0), communication_dtype=torch.bfloat16)
    p.grad = grads[rank].clone()
    opt.synchronize()
    # Each rank's gradient is cast to bfloat16 for the wire; the mean of those is rounded to bfloat16 once.
    exact = grads.bfloat16().double().mean(0)
    assert p.grad.dtype == torch.float32
    assert torch.equal(p.grad, p.grad.bfloat16().float()), "the gradient did not travel as bfloat16"
    ulp = 2.0 ** (torch.frexp(exact)[1].double() - 8)
    assert ((p.grad.double() - exact).abs() <= ulp).all(), (p.grad.double() - exact).abs().max()
    replicas_identical(backend, p.grad.reshape(-1).tolist())


# -- issue 11: backward after synchronize(), configuration agreement, sparse gradients, closures ------------------


def _mse_step_loss(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, m: int, r: int) -> torch.Tensor:
    """Micro-batch ``m`` of rank ``r``: one observation."""
    return torch.nn.functional.mse_loss(model(xs[m, r : r + 1]), ys[m, r : r + 1])


def _expected_after_sgd(
    seed: int, xs: torch.Tensor, ys: torch.Tensor, pairs: list[tuple[int, int]], scale: float
) -> list[torch.Tensor]:
    """Parameters after one SGD step (lr 0.1) on ``scale`` times the summed gradients of micro-batches ``pairs``."""
    ref = make_model(seed, bn=False).double()
    for m, r in pairs:
        _mse_step_loss(ref, xs, ys, m, r).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * scale * p.grad)
    return list(ref.parameters())


def late_backward_body(backend: dml.Backend, seed: int) -> list[str]:
    """A backward() between synchronize() and step() (or a second synchronize()) is reduced again with a
    RuntimeWarning under AVG, on every rank, also when only one rank ran it; under SUM every rank raises and
    nothing steps; a synchronize() without a backward after the first one reduces nothing; in-place edits
    between synchronize() and step() are no backward; steps add no hooks (one reduction hook per parameter).

    Returns the fragments of the RuntimeWarnings this rank must have emitted, in order: warnings are
    process-wide, so the caller records them (see ``check_warnings``).
    """
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    xs = torch.randn(3, size, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(3, size, 2, generator=g, dtype=torch.float64)
    every = list(range(size))
    last = size - 1
    expected_warnings: list[str] = []

    def warned(caller: str, ranks: list[int]) -> None:
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        expected_warnings.append(
            f"DistributedOptimizer.{caller}: backward() accumulated into the gradients after "
            f"synchronize() on {where}; they were reduced again"
        )

    def fresh(op: Any = dml.AVG, bucket_bytes: int = 256) -> tuple[torch.nn.Module, dml.DistributedOptimizer]:
        model = make_model(seed, bn=False).double()
        return model, dml.DistributedOptimizer(
            backend, torch.optim.SGD(model.parameters(), lr=0.1), op=op, bucket_bytes=bucket_bytes
        )

    def check(model: torch.nn.Module, pairs: list[tuple[int, int]], scale: float, what: str) -> None:
        for p, q in zip(model.parameters(), _expected_after_sgd(seed, xs, ys, pairs, scale), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {what}")
        hooks = [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]
        assert hooks == [1] * len(hooks), f"{what}: one reduction hook per parameter, none added per step: {hooks}"

    for bucket_bytes in (0, 1 << 20):  # gradients reduced in place / as bucket views
        # Every rank runs a second backward after synchronize(); clipping in between is no backward.
        model, opt = fresh(bucket_bytes=bucket_bytes)
        _mse_step_loss(model, xs, ys, 0, rank).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        _mse_step_loss(model, xs, ys, 1, rank).backward()
        opt.step()
        warned("step()", every)
        check(model, [(m, r) for m in (0, 1) for r in every], 1 / size, "late backward on every rank")
        # Then an ordinary step: nothing is left armed, no warning.
        opt.zero_grad()
        _mse_step_loss(model, xs, ys, 2, rank).backward()
        opt.step()

    # Only the last rank runs the extra backward: every rank reduces again and warns, naming it.
    model, opt = fresh()
    _mse_step_loss(model, xs, ys, 0, rank).backward()
    opt.synchronize()
    if rank == last:
        _mse_step_loss(model, xs, ys, 1, rank).backward()
    opt.step()
    warned("step()", [last])
    check(model, [(0, r) for r in every] + [(1, last)], 1 / size, "late backward on the last rank")

    # synchronize() twice around a backward reduces again there; step() then does not.
    model, opt = fresh()
    _mse_step_loss(model, xs, ys, 0, rank).backward()
    opt.synchronize()
    _mse_step_loss(model, xs, ys, 1, rank).backward()
    opt.synchronize()
    warned("synchronize()", every)
    opt.step()
    check(model, [(m, r) for m in (0, 1) for r in every], 1 / size, "synchronize() twice around a backward")

    # synchronize() twice with nothing in between reduces once (SUM would show a second reduction).
    model, opt = fresh(op=dml.SUM)
    _mse_step_loss(model, xs, ys, 0, rank).backward()
    opt.synchronize()
    opt.synchronize()
    opt.step()
    check(model, [(0, r) for r in every], 1.0, "synchronize() twice, SUM")

    # Under SUM a late backward (rank 0 only) cannot be reduced again exactly: every rank raises, nothing steps.
    model, opt = fresh(op=dml.SUM)
    _mse_step_loss(model, xs, ys, 0, rank).backward()
    opt.synchronize()
    if rank == 0:
        _mse_step_loss(model, xs, ys, 1, rank).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as e:
        text = str(e)
        assert "backward() accumulated into the gradients after synchronize() on rank 0" in text, text
        assert "op=dml.SUM" in text and "opt.synchronize() once per step" in text, text
    else:
        raise AssertionError(f"rank {rank}: no RuntimeError for a backward after synchronize() under SUM")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "nothing steps"
    # The optimizer and the world go on: a clean step sums once.
    opt.zero_grad()
    _mse_step_loss(model, xs, ys, 0, rank).backward()
    opt.step()
    check(model, [(0, r) for r in every], 1.0, "a step after the error")
    return expected_warnings


def check_warnings(expected: list[str], recorded: list[Any]) -> None:
    """Each recorded RuntimeWarning of DistributedOptimizer matches one ``expected`` fragment, and none is missing."""
    got = [
        str(w.message) for w in recorded if w.category is RuntimeWarning and "DistributedOptimizer" in str(w.message)
    ]
    left = list(got)
    for fragment in expected:
        match = next((m for m in left if fragment in m), None)
        assert match is not None, f"missing warning {fragment!r}; got {got}"
        left.remove(match)
    assert not left, f"unexpected warnings {left}"


# The settings DistributedOptimizer and allreduce_gradients compare across ranks.
CONFIG_SETTINGS = {
    "optimizer": ("op", "communication_dtype", "bucket_bytes", "shape", "count", "dtype"),
    "allreduce_gradients": ("op", "bucket_bytes", "shape", "count", "dtype"),
}
_OPS = ["avg", "sum", "max"]
_WIRE = [None, "bfloat16", "float16"]


@dataclass(frozen=True)
class ConfigCase:
    api: str  # "optimizer" or "allreduce_gradients"
    op: str
    communication_dtype: str | None
    bucket_bytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    setting: str  # the one that differs on rank ``odd % world``
    odd: int
    which: int  # which parameter differs (modulo their number), for shape and dtype


@st.composite
def config_cases(draw: st.DrawFn) -> ConfigCase:
    api = draw(st.sampled_from(sorted(CONFIG_SETTINGS)))
    n = draw(st.integers(1, 5))
    return ConfigCase(
        api=api,
        op=draw(st.sampled_from(_OPS)),
        communication_dtype=draw(st.sampled_from(_WIRE)) if api == "optimizer" else None,
        bucket_bytes=draw(st.sampled_from([0, 64, 1 << 20])),
        shapes=tuple(draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=n, max_size=n))),
        dtypes=tuple(draw(st.lists(st.sampled_from(["float32", "float64"]), min_size=n, max_size=n))),
        setting=draw(st.sampled_from(CONFIG_SETTINGS[api])),
        odd=draw(st.integers(0, 63)),
        which=draw(st.integers(0, 63)),
    )


def _configured(case: ConfigCase, differs: bool) -> tuple[dict[str, Any], list[tuple[int, ...]], list[str]]:
    """(keyword arguments, parameter shapes, parameter dtypes) of a rank; ``differs``: the odd rank's."""
    kwargs: dict[str, Any] = {"op": case.op, "bucket_bytes": case.bucket_bytes}
    if case.api == "optimizer":
        kwargs["communication_dtype"] = case.communication_dtype
    shapes, dtypes = list(case.shapes), list(case.dtypes)
    i = case.which % len(shapes)
    if differs:
        if case.setting == "op":
            kwargs["op"] = _OPS[(_OPS.index(case.op) + 1) % len(_OPS)]
        elif case.setting == "communication_dtype":
            kwargs["communication_dtype"] = _WIRE[(_WIRE.index(case.communication_dtype) + 1) % len(_WIRE)]
        elif case.setting == "bucket_bytes":
            kwargs["bucket_bytes"] = case.bucket_bytes + 8
        elif case.setting == "shape":
            shapes[i] = (shapes[i][0] + 1, shapes[i][1])
        elif case.setting == "count":
            shapes, dtypes = [*shapes, (2, 2)], [*dtypes, "float32"]
        else:
            dtypes[i] = "float64" if dtypes[i] == "float32" else "float32"
    if kwargs.get("communication_dtype") is not None:
        kwargs["communication_dtype"] = getattr(torch, kwargs["communication_dtype"])
    return kwargs, shapes, dtypes


def _reduce_once(backend: dml.Backend, case: ConfigCase, kwargs: dict[str, Any], params: list[torch.Tensor]) -> None:
    if case.api == "optimizer":
        dml.DistributedOptimizer(backend, torch.optim.SGD(params, lr=0.1), **kwargs).synchronize()
    else:
        dml.allreduce_gradients(backend, params, kwargs["op"], bucket_bytes=kwargs["bucket_bytes"])


def config_mismatch_body(backend: dml.Backend, case: ConfigCase) -> None:
    """One setting differs on one rank: every rank raises ValueError naming that setting, the ranks and their
    values, before any gradient moves; then the same configuration everywhere reduces exactly."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    odd = case.odd % size
    if size > 1:
        kwargs, shapes, dtypes = _configured(case, rank == odd)
        params = [
            torch.nn.Parameter(torch.zeros(s, dtype=getattr(torch, d))) for s, d in zip(shapes, dtypes, strict=True)
        ]
        for p in params:
            p.grad = torch.full_like(p, 1.0 + rank)
        try:
            _reduce_once(backend, case, kwargs, params)
        except ValueError as e:
            text = str(e)
            assert "the ranks are configured differently" in text, text
            assert f"on rank {odd}" in text, f"the odd rank {odd} is not named: {text}"
            fragment = {
                "op": "op is dml.",
                "communication_dtype": "communication_dtype is ",
                "bucket_bytes": f"{case.bucket_bytes + 8} on rank {odd}",
                "shape": f"parameter {case.which % len(case.shapes)} (",
                "count": "the number of parameters is",
                "dtype": f"parameter {case.which % len(case.shapes)} (",
            }[case.setting]
            assert fragment in text, f"{fragment!r} not in {text}"
        else:
            raise AssertionError(f"rank {rank}: no ValueError for {case.setting} differing on rank {odd}")
        assert all(torch.equal(p.grad, torch.full_like(p, 1.0 + rank)) for p in params), "no gradient moved"
    # The same configuration on every rank: the reduction is exact (small integers survive any wire dtype).
    kwargs, shapes, dtypes = _configured(case, False)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=getattr(torch, d))) for s, d in zip(shapes, dtypes, strict=True)]
    for p in params:
        p.grad = torch.full_like(p, 1.0 + rank)
    _reduce_once(backend, case, kwargs, params)
    expected = {"avg": (size + 1) / 2, "sum": size * (size + 1) / 2, "max": float(size)}[case.op]
    for p in params:
        torch.testing.assert_close(p.grad, torch.full_like(p, expected), msg=str(case))


class SparseModel(torch.nn.Module):
    """An embedding (sparse or dense gradient) and a linear layer; the embedding is optional per call."""

    def __init__(self, seed: int, sparse: bool) -> None:
        super().__init__()
        g = _gen(seed)
        self.emb = torch.nn.Embedding(12, 4, sparse=sparse).double()
        self.lin = torch.nn.Linear(4, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, idx: torch.Tensor, x: torch.Tensor, use_emb: bool) -> torch.Tensor:
        return self.lin(self.emb(idx) + x if use_emb else x)


def sparse_gradient_body(backend: dml.Backend, seed: int) -> None:
    """nn.Embedding(sparse=True) trains like one process on the full batch (dense gradients there), with SGD
    (momentum) and Adam, bucketed or in place, kept or fresh gradients, through DistributedOptimizer and
    allreduce_gradients, also when the embedding has a sparse gradient on some ranks and None on the others;
    reduced as sparse (.grad stays sparse; SGD) or, with sparse_as_dense=True, as dense (.grad dense; SGD, Adam)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    steps, per_rank = 3, 4
    idx = torch.randint(0, 12, (steps, size, per_rank), generator=g)  # repeated rows: uncoalesced gradients
    x = torch.randn(steps, size, per_rank, 4, generator=g, dtype=torch.float64)
    y = torch.randn(steps, size, per_rank, 2, generator=g, dtype=torch.float64)
    for kind, dense in (("sgd", False), ("sgd", True), ("adam", True)):
        for bucket_bytes in (0, 1 << 20):
            for keep, some_ranks, api in ((False, False, "opt"), (True, True, "opt"), (False, True, "allreduce")):
                uses = [not some_ranks or r % 2 == 1 for r in range(size)]  # None on even ranks when some_ranks
                model, ref = SparseModel(seed, sparse=True), SparseModel(seed, sparse=False)
                inner, ref_opt = _optimizer(kind, model.parameters()), _optimizer(kind, ref.parameters())
                opt = dml.DistributedOptimizer(backend, inner, bucket_bytes=bucket_bytes, sparse_as_dense=dense)
                for k in range(steps):
                    opt.zero_grad(set_to_none=not keep)
                    loss = torch.nn.functional.mse_loss(model(idx[k, rank], x[k, rank], uses[rank]), y[k, rank])
                    loss.backward()
                    if api == "opt":
                        opt.step()
                    else:
                        dml.allreduce_gradients(backend, model, bucket_bytes=bucket_bytes, sparse_as_dense=dense)
                        inner.step()
                    ref_opt.zero_grad(set_to_none=not keep)
                    total = sum(
                        torch.nn.functional.mse_loss(ref(idx[k, r], x[k, r], uses[r]), y[k, r]) for r in range(size)
                    )
                    (total / size).backward()
                    ref_opt.step()
                what = f"rank {rank}: {kind}, {dense=}, {bucket_bytes=}, {keep=}, some={some_ranks}, {api}"
                grad = model.emb.weight.grad
                assert grad is None or grad.layout == (torch.strided if dense else torch.sparse_coo), what
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=what)


def closure_body(backend: dml.Backend, seed: int) -> float:
    """step(closure) reduces the gradients after every closure call and reduces the loss, so LBFGS on the shards
    is LBFGS on the full batch, and SGD with a closure is SGD on the full batch."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    g = _gen(seed)
    x = torch.randn(size * 3, 3, generator=g, dtype=torch.float64)
    y = torch.randn(size * 3, 2, generator=g, dtype=torch.float64)
    losses = []
    for kind in ("lbfgs", "sgd"):
        model, ref = make_model(seed, bn=False).double(), make_model(seed, bn=False).double()

        def make(params: Any) -> torch.optim.Optimizer:
            if kind == "lbfgs":
                return torch.optim.LBFGS(params, lr=0.5, max_iter=6, line_search_fn="strong_wolfe")
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)

        opt, ref_opt = dml.DistributedOptimizer(backend, make(model.parameters())), make(ref.parameters())

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rank::size]), y[rank::size])
            loss.backward()
            return loss

        def ref_closure() -> torch.Tensor:
            ref_opt.zero_grad()
            loss = sum(torch.nn.functional.mse_loss(ref(x[r::size]), y[r::size]) for r in range(size)) / size
            loss.backward()
            return loss

        for _ in range(2):
            loss = opt.step(closure)
            ref_loss = ref_opt.step(ref_closure)
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-9, atol=1e-12, msg=kind)
            losses.append(float(loss))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9, msg=f"rank {rank}: {kind}")
    return sum(losses)


def grad_storage_moved_body(backend: dml.Backend, shard: bool, overlap: bool, how: str, set_to_none: bool) -> None:
    """``p.grad.data = ...`` or ``p.grad.set_(...)`` at step 0 (the same values, or doubled, in new storage): every
    step after it, as before it, is one process's step on all the ranks' batches (the gradient handed out as
    ``.grad`` no longer aliased the library's buffer: the steps read stale values, or replicas diverged)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)

    def made() -> torch.nn.Module:
        g = _gen(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
        return model

    model, ref = made(), made()
    opt = dml.DistributedOptimizer(
        backend, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shard_state=shard, overlap=overlap
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def moved(grad: torch.Tensor) -> None:
        if how == "data":
            grad.data = grad.data * 2
        else:
            grad.set_(grad.detach().clone() * 2)

    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad()
        batches = [
            (torch.randn(8, 4, generator=_gen(10 * step + r), dtype=torch.float64), torch.full((8, 3), float(r)))
            for r in range(size)
        ]
        x, y = batches[rank]
        (model(x) - y).pow(2).mean().backward()
        torch.cat([(ref(xb) - yb).pow(2).mean(1) for xb, yb in batches]).mean().backward()  # equal batches
        if step == 0:
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                moved(p.grad)
                q.grad.mul_(2)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12)
    assert replicas_identical(backend, torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
