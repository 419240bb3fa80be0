"""Bodies for ``synchronize`` and ``broadcast_buffers``, run on LocalBackend and under MPI.

tests/test_synchronize.py and tests/test_buffers.py run these bodies on
``dml.LocalBackend.spawn``; under MPI they run as ``mpiexec -n N python tests/sync_job.py
CHECK...`` (hypothesis derandomized, so every rank draws the same examples; a failing
body prints its rank and traceback and aborts the job). Rank 0 ends with
``SYNC CHECKS PASSED`` when all passed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.backends.local import current_spawned_backend

# -- helpers ----------------------------------------------------------------------------------


def world_usable(b: dml.Backend) -> None:
    """A good collective right after: no rank was left behind or has stale data queued."""
    buf = np.full(6, 100.0) if b.rank == 0 else np.zeros(6)
    dml.bcast(b, buf, root=0)
    assert (buf == 100.0).all(), f"rank {b.rank}: the next bcast received {buf}"
    total = np.ones(2)
    dml.allreduce(b, total, dml.SUM)
    assert (total == b.size).all(), total


def raised(fn: Callable[[], Any], *kinds: type[BaseException]) -> tuple[type[BaseException] | None, str]:
    """(exception class, message) of ``fn()``, or (None, "no error")."""
    try:
        fn()
    except kinds as e:
        return type(e), str(e)
    return None, "no error"


# -- item 1: nothing fails on one rank after the agreement ------------------------------------


def negative_strides_body(b: dml.Backend) -> None:
    """The issue's reproducer: rank 1 passes a reversed view; the next bcast gets fresh data."""
    rank = b.rank
    w = np.arange(4.0) if rank == 0 else np.arange(4.0)[::-1]
    x = {"w": w, "b": np.zeros(2) + rank}
    out = dml.synchronize(b, x)
    assert out["w"] is w and out["b"] is x["b"], "arrays are synchronized in place"
    np.testing.assert_array_equal(w, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(out["b"], [0.0, 0.0])
    if rank:
        np.testing.assert_array_equal(w.base, [3.0, 2.0, 1.0, 0.0])  # written through the reversed view
    dml.barrier(b)
    world_usable(b)


def one_rank_layout_body(b: dml.Backend) -> None:
    """A leaf that is non-contiguous on one rank only changes no rank's collectives."""
    last = b.rank == b.size - 1
    single = torch.zeros(3, 2).t() if last else torch.zeros(2, 3)  # the only float32 leaf: travels alone
    pair = [np.zeros((4, 3))[:, ::2] if last else np.zeros((4, 2)), np.zeros(5)]  # a float64 group of two
    if b.rank == 0:
        single.copy_(torch.arange(6.0).reshape(2, 3))
        pair[0][:] = 7.0
        pair[1][:] = np.arange(5.0)
    out = dml.synchronize(b, {"single": single, "pair": pair})
    assert out["single"] is single
    torch.testing.assert_close(single, torch.arange(6.0).reshape(2, 3), rtol=0, atol=0)
    assert (pair[0] == 7.0).all() and (pair[1] == np.arange(5.0)).all()
    if last:
        assert (pair[0].base[:, 1::2] == 0.0).all(), "elements outside the view were written"
    world_usable(b)


class RootOnly:
    """Pickles on root; on another simulated rank, unpickling fails as for a class only in root's ``__main__``."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        maker = current_spawned_backend()
        return _root_only, (0 if maker is None else maker.rank,)


def _root_only(maker: int) -> RootOnly:
    here = current_spawned_backend()
    if here is not None and here.rank != maker:
        raise AttributeError("Can't get attribute 'RootOnly' on <module '__main__'>")
    return RootOnly()


def unpicklable_body(b: dml.Backend, make: Callable[[], Any]) -> None:
    """Root's plain value that another rank cannot unpickle: every rank raises, nothing moves."""
    root = b.size - 1
    w = torch.full((3,), float(b.rank))
    x = {"w": w, "cfg": make() if b.rank == root else None}
    kind, msg = raised(lambda: dml.synchronize(b, x, root=root), Exception)
    assert kind is RuntimeError, (kind, msg)
    others = [r for r in range(b.size) if r != root]
    assert f"rank(s) {others} cannot take part" in msg, msg
    assert "x['cfg']" in msg and "cannot be unpickled" in msg and "AttributeError" in msg, msg
    assert (w == b.rank).all(), "no array moved"
    world_usable(b)


class FailingCopy(torch.Tensor):
    """A tensor that refuses to be written by ``copy_``: a failure no check before the agreement sees."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and isinstance(args[0], FailingCopy):
            raise RuntimeError("copy_ refused by FailingCopy")
        return super().__torch_function__(func, types, args, kwargs or {})


def late_failure_body(b: dml.Backend) -> None:
    """Rank 1 fails after the agreement (writing root's data back): the job is aborted, never one rank raising."""
    a = torch.zeros(2)
    x = {"a": a.as_subclass(FailingCopy) if b.rank == 1 else a, "b": torch.zeros(3)}
    dml.synchronize(b, x)
    dml.barrier(b)
    dml.print(b, "not aborted")


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    leaves: tuple[tuple[tuple[int, ...], str, str], ...]  # (shape, dtype, "numpy" | "torch")
    layouts: tuple[int, ...]  # per leaf: the first rank's layout; rank r uses the next r-th
    root: int


LAYOUTS = ("contiguous", "reversed", "strided", "transposed", "fortran", "readonly")
_TORCH = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int8": torch.int8,
    "bool": torch.bool,
}


@st.composite
def layout_cases(draw: st.DrawFn) -> LayoutCase:
    leaf = st.tuples(
        st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
        st.sampled_from([*_TORCH, "uint16"]),
        st.sampled_from(["numpy", "torch"]),
    )
    leaves = tuple(draw(st.lists(leaf, min_size=1, max_size=6)))
    layouts = tuple(draw(st.integers(0, len(LAYOUTS) - 1)) for _ in leaves)
    return LayoutCase(leaves, layouts, draw(st.integers(0, 2)))


def _data(shape: tuple[int, ...], dtype: str, rank: int, i: int) -> np.ndarray:
    """Leaf ``i``'s values on ``rank`` (float64 or bool, cast later)."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return ((np.arange(n) + rank + i) % 2 == 0).reshape(shape)
    return ((np.arange(n) * (rank + 1) + 10 * i + rank) % 100).reshape(shape).astype(np.float64)


def _laid_out(values: np.ndarray, dtype: str, kind: str, layout: str, is_root: bool) -> tuple[Any, Any, Any]:
    """(leaf, base, mask): ``values`` in ``layout``; ``base`` holds the leaf, ``mask`` its elements outside it."""
    if kind == "numpy" and dtype == "bfloat16":
        kind = "torch"
    if kind == "torch" and dtype == "uint16":
        kind = "numpy"
    if layout == "readonly" and (kind == "torch" or not is_root):
        layout = "contiguous"  # a read-only array can only be sent (root), never received
    if layout == "reversed" and (kind == "torch" or values.ndim == 0):
        layout = "strided"  # torch has no negative strides
    if layout in ("transposed", "fortran") and values.ndim < 2:
        layout = "strided"
    if layout == "strided" and values.ndim == 0:
        layout = "contiguous"

    def make(a: np.ndarray) -> Any:
        return np.array(a, dtype=np.dtype(dtype)) if kind == "numpy" else torch.tensor(a).to(_TORCH[dtype])

    if layout in ("contiguous", "readonly"):
        leaf = make(values)
        if layout == "readonly":
            leaf.flags.writeable = False
        return leaf, leaf, None
    if layout == "reversed":
        base = make(values[::-1].copy())
        return base[::-1], base, None
    if layout == "strided":
        sentinel = np.zeros((2 * values.shape[0], *values.shape[1:]), dtype=values.dtype)
        sentinel[::2] = values
        sentinel[1::2] = 1
        base = make(sentinel)
        mask = np.zeros(sentinel.shape, dtype=bool)
        mask[1::2] = True
        return base[::2], base, mask
    if layout == "transposed":
        base = make(np.ascontiguousarray(np.swapaxes(values, 0, 1)))
        return (base.swapaxes(0, 1) if kind == "numpy" else base.transpose(0, 1)), base, None
    if kind == "numpy":
        base = np.asfortranarray(make(values))
        return base, base, None
    axes = tuple(reversed(range(values.ndim)))  # torch's column-major: a permuted contiguous tensor
    base = make(np.ascontiguousarray(values.transpose(axes)))
    return base.permute(*axes), base, None


def _as_numpy(a: Any) -> np.ndarray:
    return a.float().numpy() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else np.asarray(a)


def layouts_body(b: dml.Backend, case: LayoutCase) -> None:
    """Leaves of every layout (different on every rank) end as root's; nothing outside a view is written."""
    rank, root = b.rank, case.root % b.size
    made = []
    for i, ((shape, dtype, kind), first) in enumerate(zip(case.leaves, case.layouts, strict=True)):
        layout = LAYOUTS[(first + rank * (i + 1)) % len(LAYOUTS)]
        made.append(_laid_out(_data(shape, dtype, rank, i), dtype, kind, layout, rank == root))
    leaves = [leaf for leaf, _, _ in made]
    out = dml.synchronize(b, {"leaves": leaves, "n": rank}, root=root)
    assert out["n"] == root
    for i, ((shape, dtype, _), (leaf, base, mask)) in enumerate(zip(case.leaves, made, strict=True)):
        assert out["leaves"][i] is leaf
        expected = _data(shape, dtype, root, i)
        got = _as_numpy(leaf)
        assert got.shape == expected.shape and (got == expected.astype(got.dtype)).all(), (i, case, got, expected)
        if mask is not None:
            assert (_as_numpy(base)[mask] == 1).all(), f"leaf {i}: elements outside the view were written"
    world_usable(b)


# -- item 2: dict keys matched by value -----------------------------------------------------------


class Color(enum.Enum):
    RED = 1
    GREEN = "green"


# Distinct keys (no two equal as dict keys: no 0/1 next to False/True, no 2.0 next to 2), each
# with the spellings a rank may use for it.
KEY_POOL: list[list[Any]] = [
    [2, np.int64(2), np.int32(2), np.uint8(2)],
    [3, np.int64(3), np.int16(3)],
    [-7, np.int64(-7)],
    [0.5, np.float64(0.5), np.float32(0.5)],
    [-2.25, np.float32(-2.25), np.float16(-2.25)],
    [True, np.bool_(True)],
    [False, np.bool_(False)],
    ["a", np.str_("a")],
    ["weight", np.str_("weight")],
    [b"k"],
    [None],
    [("a", 2), ("a", np.int64(2)), (np.str_("a"), np.int8(2))],
    [(3, ("x", None)), (np.int64(3), ("x", None))],
    [Color.RED],
    [Color.GREEN],
]


@dataclasses.dataclass(frozen=True)
class KeyCase:
    keys: tuple[int, ...]  # indices into KEY_POOL
    seed: int
    root: int
    mapping: str  # "dict" or "defaultdict"


@st.composite
def key_cases(draw: st.DrawFn) -> KeyCase:
    keys = draw(st.lists(st.integers(0, len(KEY_POOL) - 1), min_size=1, max_size=8, unique=True))
    return KeyCase(
        tuple(keys),
        draw(st.integers(0, 10_000)),
        draw(st.integers(0, 2)),
        draw(st.sampled_from(["dict", "defaultdict"])),
    )


def _index_of(key: Any) -> int:
    return next(i for i, spellings in enumerate(KEY_POOL) if any(_same(key, s) for s in spellings))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return a is b
    return isinstance(a, (bool, np.bool_)) == isinstance(b, (bool, np.bool_)) and a == b


def keys_body(b: dml.Backend, case: KeyCase) -> None:
    """Each rank inserts the keys in its own order and spelling; every value lands under its key."""
    rank, root = b.rank, case.root % b.size
    rng = np.random.default_rng(case.seed + 97 * rank)
    mine: dict[Any, Any] = {} if case.mapping == "dict" else collections.defaultdict(list)
    for j in rng.permutation(len(case.keys)):
        spellings = KEY_POOL[case.keys[j]]
        mine[spellings[rng.integers(len(spellings))]] = torch.full((2,), float(100 * rank + case.keys[j]))
    items = [(k, v.clone()) for k, v in mine.items()]
    nested = {"inner": dict(reversed(items) if rank % 2 else items)}
    order = list(mine)
    out = dml.synchronize(b, {"d": mine, "n": nested}, root=root)
    assert type(out["d"]) is type(mine) and list(out["d"]) == order, "each rank keeps its own keys and order"
    for d in (out["d"], out["n"]["inner"]):
        for k, v in d.items():
            assert (v == 100 * root + _index_of(k)).all(), f"rank {rank}: key {k!r} got {v} ({case})"


def numpy_keys_body(b: dml.Backend) -> None:
    """The issue's case: {np.int64(0): a, np.int64(1): b} against the other insertion order."""
    keys = [np.int64(0), np.int64(1)]
    if b.rank % 2:
        keys.reverse()
    x = {k: torch.full((3,), float(10 * b.rank + int(k))) for k in keys}
    out = dml.synchronize(b, x)
    assert list(out) == keys
    for k in keys:
        assert (out[k] == int(k)).all(), f"rank {b.rank}: key {k} holds {out[k]}, root's is {int(k)}"
    world_usable(b)


class Opaque:
    """A key type ranks cannot compare."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def custom_keys_body(b: dml.Backend) -> None:
    """Keys that are not plain values raise TypeError on every rank, naming the path and key type."""
    for culprit in range(b.size):  # on root, on another rank, and on every rank
        for everywhere in (False, True):
            bad = everywhere or b.rank == culprit
            keys = [Opaque(0), Opaque(1)] if bad else ["p", "q"]
            w = torch.full((2,), float(b.rank))
            x = {"model": {"layers": {k: w if i == 0 else torch.zeros(1) for i, k in enumerate(keys)}}}
            kind, msg = raised(lambda x=x: dml.synchronize(b, x), Exception)
            assert kind is TypeError, (kind, msg)
            assert "x['model']['layers']" in msg and ".Opaque" in msg, msg
            assert "str, int, float, bool, bytes, None" in msg, msg
            assert (w == b.rank).all(), "no array moved"
            if everywhere:
                break
    world_usable(b)


# -- item 16: BatchNorm ------------------------------------------------------------------------


def bn_model(seed: int, sync_bn: bool = False) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.SyncBatchNorm(6) if sync_bn else torch.nn.BatchNorm1d(6)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), norm, torch.nn.Linear(6, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def sync_batchnorm_body(b: dml.Backend) -> None:
    """nn.SyncBatchNorm without a torch.distributed group raises on every rank of a world of several, even on one."""
    for only in [None, *range(b.size)]:
        model = bn_model(1, sync_bn=only is None or b.rank == only)
        for call in (lambda m=model: dml.synchronize(b, m), lambda m=model: dml.broadcast_buffers(b, m)):
            kind, msg = raised(call, Exception)
            if b.size == 1:
                assert kind is None, msg
                continue
            assert kind is RuntimeError, (kind, msg)
            assert "x.2" in msg or "module.2" in msg, msg
            assert "torch.nn.SyncBatchNorm" in msg and "torch.nn.BatchNorm1d" in msg, msg
            assert "dml.broadcast_buffers" in msg, msg
            assert "model = dml.convert_sync_batchnorm(backend, model)" in msg and "planned" not in msg, msg
    world_usable(b)


def buffers_eval_body(b: dml.Backend) -> None:
    """After training, the first evaluation forward puts root's buffers everywhere (values only: any backend)."""
    rank, root = b.rank, b.size - 1
    model = bn_model(rank)  # different weights and buffers on every rank
    dml.synchronize(b, model, root=root)
    handle = dml.broadcast_buffers(b, model, root=root)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(8, 3, generator=g)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 3, generator=g))
        state = torch.cat([t.double().reshape(-1) for t in model.buffers()]).numpy()
        every = np.empty((b.size, state.size))
        dml.allgather(b, state, every)
        assert (every == every[root]).all(), "evaluation buffers differ across ranks"
    handle.remove()
    model.train()
    model(torch.randn(8, 3, generator=g))  # no collective once removed
    world_usable(b)


def ddp_buffers_body(b: dml.Backend, keep: list[Any], epochs: int) -> None:
    """ddp_buffers_check's comparison, inside ``mpi_main.gloo_group``; ``keep`` gets the DDP wrapper."""
    rank, size = b.rank, b.size
    ddp = torch.nn.parallel.DistributedDataParallel(bn_model(rank))  # copies rank 0's model
    keep.append(ddp)
    models = {"ddp": ddp, "ours": bn_model(rank), "plain": bn_model(rank)}
    for name in ("ours", "plain"):
        dml.synchronize(b, models[name])
    handle = dml.broadcast_buffers(b, models["ours"])
    opts = {
        "ddp": torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
        "ours": dml.DistributedOptimizer(b, torch.optim.SGD(models["ours"].parameters(), lr=0.1, momentum=0.9)),
        "plain": dml.DistributedOptimizer(b, torch.optim.SGD(models["plain"].parameters(), lr=0.1, momentum=0.9)),
    }
    g = torch.Generator().manual_seed(123)
    plain_differs = False
    for _ in range(epochs):
        xs = torch.randn(4, 8 * size, 3, generator=g)
        ys = torch.randn(4, 8 * size, 2, generator=g)
        evals = torch.randn(3, 5 * size, 3, generator=g)
        outs = {}
        for name, model in models.items():
            model.train()
            for x, y in zip(xs, ys, strict=True):
                opts[name].zero_grad()
                torch.nn.functional.mse_loss(model(x[rank::size]), y[rank::size]).backward()
                opts[name].step()
            model.eval()
            with torch.no_grad():
                outs[name] = torch.cat([model(e[rank::size]) for e in evals])
        assert torch.equal(outs["ours"], outs["ddp"]), (outs["ours"] - outs["ddp"]).abs().max()
        for mine, theirs in zip(models["ours"].buffers(), ddp.module.buffers(), strict=True):
            assert torch.equal(mine, theirs), "buffers differ from DDP's"
        for mine, theirs in zip(models["ours"].parameters(), ddp.module.parameters(), strict=True):
            assert torch.equal(mine, theirs), "parameters differ from DDP's"
        plain_differs = plain_differs or not torch.equal(outs["plain"], outs["ddp"])
    flags = np.empty(size, dtype=np.int8)
    dml.allgather(b, np.array(plain_differs, dtype=np.int8), flags)
    assert flags.any(), "without broadcast_buffers the evaluation should differ from DDP's on some rank"
    handle.remove()


def ddp_buffers_check(b: dml.Backend, epochs: int = 3) -> None:
    """Per-epoch evaluation with BatchNorm: outputs and buffers bitwise equal to torch DDP (gloo)."""
    from mpi_main import gloo_group  # here: importing mpi4py would start MPI in the LocalBackend tests

    with gloo_group(b) as keep:
        ddp_buffers_body(b, keep, epochs)


# -- MPI ------------------------------------------------------------------------------------------


def main(checks: list[str]) -> None:
    import faulthandler
    import signal

    from mpi_main import guarded, hypothesis_check, run_checks

    faulthandler.register(signal.SIGUSR1)
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checker = dml.MPIBackend(debug=True)  # compares every collective across ranks: a rank-local path shows
    rank = world.rank

    def root_only_class() -> Any:
        """A class that exists in ``__main__`` on root only (what a rank-conditional definition gives)."""
        main_module = sys.modules["__main__"]
        if rank == world.size - 1:
            main_module.OnlyOnRoot = type("OnlyOnRoot", (), {"__module__": "__main__"})
        return main_module.OnlyOnRoot()

    def run_check(check: str) -> Any:
        if check == "reproducers":
            for b in (world, checker):
                guarded(negative_strides_body, b)
                guarded(one_rank_layout_body, b)
            guarded(unpicklable_body, world, root_only_class)
            return "ok"
        elif check == "layouts":
            return hypothesis_check(world, layouts_body, layout_cases(), 25)
        elif check == "keys":
            guarded(numpy_keys_body, world)
            guarded(custom_keys_body, world)
            return hypothesis_check(world, keys_body, key_cases(), 25)
        elif check == "batchnorm":
            guarded(sync_batchnorm_body, world)
            guarded(buffers_eval_body, world)
            return "ok"
        elif check == "ddp_buffers":
            guarded(ddp_buffers_check, world)
            return "bitwise equal"
        elif check == "late_failure":
            late_failure_body(world)
            return "not aborted"
        raise SystemExit(f"unknown check {check!r}")

    run_checks(world, checks, "SYNC CHECKS PASSED", run_check)


if __name__ == "__main__":
    main(sys.argv[1:])
