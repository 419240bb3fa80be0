"""Test bodies shared by every backend: each takes ``(backend, case)`` and asserts.

A body runs on every rank. Every rank can rebuild every other rank's input from the
case's seed, so expected results are computed locally, without communication. The
same bodies run on ``LocalBackend.spawn`` (tests/test_collectives.py) and inside real
``mpiexec`` jobs (tests/mpi_main.py), where hypothesis draws the same examples on
every rank (seeded). Cases come from hypothesis (``cases``: random shapes, spellings,
roots for one dtype) and from a deterministic matrix (``matrix_cases``: every allowed
op x dtype x call form x 0-d/empty/odd shape), which ``matrix_body`` runs in one body.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.backends.base import resolve_op

INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
DTYPES = (*INT_DTYPES, *FLOAT_DTYPES, "bool")
REDUCTIONS = ("allreduce", "reduce")
# Every accepted spelling of each op.
SPELLINGS = {
    dml.SUM: (dml.SUM, "sum", operator.add),
    dml.PROD: (dml.PROD, "prod", operator.mul),
    dml.MAX: (dml.MAX, "max", max),
    dml.MIN: (dml.MIN, "min", min),
    dml.AVG: (dml.AVG, "avg"),
}
# Bits of significand (the implicit one included) of the half-precision dtypes.
SIGNIFICAND_BITS = {"float16": 11, "bfloat16": 8}
# Unit roundoff of the dtypes whose reductions are checked to a tolerance.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53}


def ops_for(dtype: str) -> tuple[dml.ReduceOp, ...]:
    """The reductions allowed on ``dtype``: MAX and MIN on bool, AVG on floating point only."""
    if dtype == "bool":
        return (dml.MAX, dml.MIN)
    return (dml.SUM, dml.PROD, dml.MAX, dml.MIN) + ((dml.AVG,) if dtype in FLOAT_DTYPES else ())


def kinds_for(dtype: str) -> tuple[str, ...]:
    """The buffer kinds that hold ``dtype`` (NumPy has no bfloat16)."""
    return ("torch",) if dtype == "bfloat16" else ("numpy", "torch")


@dataclass(frozen=True)
class Case:
    """One collective call."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # "numpy" or "torch"
    op: Any  # an accepted spelling; None for bcast and allgather
    root_draw: int  # root = root_draw % world size
    in_place: bool
    strided_send: bool  # two-buffer form: pass a non-contiguous sendbuf
    seed: int

    def root(self, size: int) -> int:
        return self.root_draw % size


@st.composite
def cases(draw: st.DrawFn, dtype: str, *, reduction: bool = True, max_elems: int = 64) -> Case:
    """A random call on ``dtype`` buffers: op and spelling, buffer kind, shape (0-d and empty included), root, form."""
    spelling = None
    if reduction:
        spelling = draw(st.sampled_from(SPELLINGS[draw(st.sampled_from(ops_for(dtype)))]))
    kind = draw(st.sampled_from(kinds_for(dtype)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    if int(np.prod(shape)) > max_elems:
        shape = shape[:1]
    in_place = draw(st.booleans())
    return Case(
        shape=shape,
        dtype=dtype,
        kind=kind,
        op=spelling,
        root_draw=draw(st.integers(0, 63)),
        in_place=in_place,
        strided_send=not in_place and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# The deterministic matrix: 0-d, empty and odd shapes (the odd one spans several
# segments on a backend with 16-byte segments, even in int8) in each call form.
MATRIX_SHAPES = ((), (2, 0, 3), (3, 7))
FORMS = ("in_place", "two_buffer", "strided_send")


@cache
def matrix_cases(name: str) -> tuple[Case, ...]:
    """Every allowed (op, dtype) of collective ``name`` x every form x every shape.

    Buffer kinds, spellings and roots rotate from one case to the next, so each (op,
    dtype) meets both kinds in each form, each op every spelling, and each rank is root.
    """
    out: list[Case] = []
    forms = FORMS[1:] if name == "allgather" else FORMS  # allgather has no in-place form
    for dtype in DTYPES:
        kinds = kinds_for(dtype)
        for op, form, shape in itertools.product(
            ops_for(dtype) if name in REDUCTIONS else (None,), forms, MATRIX_SHAPES
        ):
            if form == "strided_send" and shape == ():
                continue  # a 0-d view is contiguous
            i = len(out)
            spelling = None if op is None else SPELLINGS[op][i % len(SPELLINGS[op])]
            out.append(
                Case(shape, dtype, kinds[i % len(kinds)], spelling, i, form == "in_place", form == "strided_send", i)
            )
    return tuple(out)


# -- inputs and expected results ---------------------------------------------------------


@lru_cache(maxsize=256)  # every rank rebuilds every rank's input: on LocalBackend.spawn, once for all
def values(case: Case, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s input in a world of ``size``: read-only float64/int64/bool values exact in ``case.dtype``.

    Integers carry a large offset (of alternating sign on signed dtypes) that a reduction
    through a narrower or floating-point type would lose; no result overflows.
    Half-precision inputs make the float32 reduction exact in any order: sums and means
    of values with |v| in [1/16, 10] (their bits, 2^5 down to 2^-14, fit in float32's 24)
    and products of floor(24 / size)-bit significands. So the result must be exactly the
    true one rounded once to the half dtype, whereas rounding to half after each step
    (a native half-precision reduction) differs.
    """
    v = np.array(_values(case, rank, size))
    v.flags.writeable = False
    return v


def _values(case: Case, rank: int, size: int) -> np.ndarray:
    rng = np.random.default_rng([case.seed, rank])
    op = dml.SUM if case.op is None else resolve_op(case.op)
    if case.dtype == "bool":
        return rng.random(case.shape) < 0.5
    if case.dtype in INT_DTYPES:
        unsigned = case.dtype.startswith("u")
        v = rng.integers(0 if unsigned else -2, (2 if op is dml.PROD else 3) + 1, size=case.shape)
        if op is not dml.PROD:
            offset = int(np.iinfo(case.dtype).max) // 8
            v += offset if unsigned or rank % 2 == 0 else -offset
        return v
    sign = rng.integers(0, 2, case.shape) * 2.0 - 1.0
    if case.dtype in HALF_DTYPES and op is dml.PROD:
        bits = min(SIGNIFICAND_BITS[case.dtype], 24 // size)
        significand = rng.integers(2 ** (bits - 1), 2**bits, case.shape) / 2 ** (bits - 1)
        v = sign * significand * 2.0 ** rng.integers(-1, 1, case.shape)
    elif case.dtype in HALF_DTYPES:
        v = sign * np.maximum(rng.uniform(0.0, 10.0, case.shape), 1 / 16)
    elif op is dml.PROD:
        v = sign * rng.uniform(0.5, 2.0, case.shape)
    else:
        v = rng.uniform(-10.0, 10.0, case.shape)
    return as_float64(make(case, v))


def make(case: Case, v: np.ndarray) -> Any:
    """A fresh buffer of the case's kind and dtype holding ``v`` (and ``v``'s shape)."""
    if case.dtype == "bfloat16":
        return torch.from_numpy(np.array(v, dtype=np.float64)).to(torch.bfloat16)
    a = np.array(v).astype(case.dtype)  # rounds to nearest even, as torch does
    return a if case.kind == "numpy" else torch.from_numpy(a)


def as_float64(buf: Any) -> np.ndarray:
    """The values of a buffer, as float64 (int64 for integers, bool for bool)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype == torch.bfloat16:
            return buf.to(torch.float64).numpy()
        buf = buf.numpy()
    if buf.dtype == np.bool_:
        return buf.copy()
    return buf.astype(np.float64 if buf.dtype.kind == "f" else np.int64)


def sendbuf(case: Case, v: np.ndarray) -> Any:
    """The case's send buffer holding ``v``: contiguous, or a strided view when asked."""
    if not case.strided_send or case.shape == ():
        return make(case, v)
    big = make(case, np.repeat(np.asarray(v)[..., None], 2, axis=-1))
    return big[..., 0]


def expected_reduction(case: Case, inputs: list[np.ndarray]) -> np.ndarray:
    """The reduction of ``inputs``; for float16/bfloat16, the float32 result rounded once to the dtype."""
    op = resolve_op(case.op)
    stack = np.stack(inputs)
    if op is dml.MAX:
        return np.asarray(stack.max(axis=0))
    if op is dml.MIN:
        return np.asarray(stack.min(axis=0))
    total = np.prod(stack, axis=0) if op is dml.PROD else np.sum(stack, axis=0)
    if case.dtype not in HALF_DTYPES:
        return np.asarray(total / len(inputs) if op is dml.AVG else total)
    exact32 = np.asarray(total, dtype=np.float32)  # exact: see values()
    assert (exact32 == total).all(), "inputs whose float32 reduction is inexact"
    if op is dml.AVG:
        exact32 = exact32 / np.float32(len(inputs))
    return as_float64(make(case, exact32.astype(np.float64)))


def assert_reduced(case: Case, got: Any, inputs: list[np.ndarray]) -> None:
    """``got`` holds the reduction of ``inputs``.

    Exact for integers, bool, MAX/MIN and float16/bfloat16 (the float32 reduction rounded
    once); float32/float64 SUM, PROD and AVG within the error bound of a reduction in
    that dtype, 2 * world size * unit roundoff, relative to the sum of |inputs| (to
    |result| for PROD).
    """
    exp = expected_reduction(case, inputs)
    g = as_float64(got)
    assert g.shape == exp.shape, (g.shape, exp.shape)
    op, n = resolve_op(case.op), len(inputs)
    if case.dtype in UNIT_ROUNDOFF and op not in (dml.MAX, dml.MIN):
        scale = np.abs(exp) if op is dml.PROD else np.sum(np.abs(np.stack(inputs)), axis=0)
        if op is dml.AVG:
            scale = scale / n
        bad = np.abs(g - exp) > 2 * n * UNIT_ROUNDOFF[case.dtype] * scale
        assert not bad.any(), f"{case}: got {g[bad][:5]}, expected {exp[bad][:5]}"
    else:
        np.testing.assert_array_equal(g, exp, err_msg=str(case), strict=True)


def assert_same(got: Any, exp: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(as_float64(got), exp, err_msg=what)


# -- bodies -------------------------------------------------------------------------------


def allreduce_body(backend: dml.Backend, case: Case) -> np.ndarray:
    """allreduce equals the element-wise reduction of all ranks' inputs."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    inputs = [values(case, r, size) for r in range(size)]
    if case.in_place:
        buf = make(case, inputs[rank])
        out = dml.allreduce(backend, buf, case.op)
        assert out is buf
    else:
        send = sendbuf(case, inputs[rank])
        recv = make(case, np.zeros(case.shape))
        out = dml.allreduce(backend, send, recv, case.op)
        assert out is recv
        assert_same(send, inputs[rank], "allreduce changed sendbuf")
    assert_reduced(case, out, inputs)
    return as_float64(out)


def bcast_body(backend: dml.Backend, case: Case) -> np.ndarray:
    """bcast gives every rank root's data and leaves root's data alone."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    root = case.root(size)
    inputs = [values(case, r, size) for r in range(size)]
    if case.in_place:
        buf = make(case, inputs[rank])
        out = dml.bcast(backend, buf, root=root)
        assert out is buf
    else:
        send = sendbuf(case, inputs[rank])
        recv = make(case, np.zeros(case.shape))
        out = dml.bcast(backend, send, recv, root=root)
        assert out is recv
        assert_same(send, inputs[rank], "bcast changed sendbuf")
    assert_same(out, inputs[root], f"bcast from root {root}: {case}")
    return as_float64(out)


def reduce_body(backend: dml.Backend, case: Case) -> np.ndarray:
    """reduce puts the result on root and leaves other ranks' buffers unchanged."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    root = case.root(size)
    inputs = [values(case, r, size) for r in range(size)]
    if case.in_place:
        buf = make(case, inputs[rank])
        out = dml.reduce(backend, buf, case.op, root=root)
        assert out is buf
        untouched = inputs[rank]
    else:
        send = sendbuf(case, inputs[rank])
        recv = make(case, np.ones(case.shape))
        untouched = as_float64(recv)
        out = dml.reduce(backend, send, recv, case.op, root=root)
        assert out is recv
        assert_same(send, inputs[rank], "reduce changed sendbuf")
    if rank == root:
        assert_reduced(case, out, inputs)
    else:
        assert_same(out, untouched, f"reduce changed rank {rank}'s buffer (root {root})")
    return as_float64(out)


def allgather_body(backend: dml.Backend, case: Case) -> np.ndarray:
    """allgather stacks every rank's sendbuf in rank order."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    inputs = [values(case, r, size) for r in range(size)]
    send = sendbuf(case, inputs[rank])
    recv = make(case, np.zeros((size, *case.shape)))
    out = dml.allgather(backend, send, recv)
    assert out is recv
    assert_same(send, inputs[rank], "allgather changed sendbuf")
    assert_same(out, np.stack(inputs), f"allgather: {case}")
    return as_float64(out)


BODIES = {
    "allreduce": allreduce_body,
    "bcast": bcast_body,
    "reduce": reduce_body,
    "allgather": allgather_body,
}


def matrix_size() -> int:
    return sum(len(matrix_cases(name)) for name in BODIES)


def matrix_body(backend: dml.Backend) -> int:
    """Every case of :func:`matrix_cases`, for every collective, in one body; returns how many ran."""
    count = 0
    for name, body in BODIES.items():
        for case in matrix_cases(name):
            try:
                body(backend, case)
            except AssertionError as e:
                raise AssertionError(f"{name} on {dml.total_workers(backend)} ranks, {case}: {e}") from None
            count += 1
    return count


# -- bad input ---------------------------------------------------------------------------


def bad_calls(backend: dml.Backend) -> list[tuple[str, type[Exception], str, Any]]:
    """(name, exception type, message fragment, call) for every documented bad input."""
    size = dml.total_workers(backend)
    f32 = np.zeros(4, dtype=np.float32)
    t32 = torch.zeros(4)
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    sq, tsq = np.zeros((2, 2), dtype=np.float32), torch.zeros(2, 2)
    g32 = np.zeros((size, 4), dtype=np.float32)
    b = backend
    return [
        ("unknown op string", ValueError, "op: got 'mean'", lambda: dml.allreduce(b, f32, "mean")),
        ("unknown op object", ValueError, "op: got", lambda: dml.allreduce(b, f32, operator.sub)),
        ("unhashable op", ValueError, "op: got [1]", lambda: dml.reduce(b, f32, [1])),
        ("missing op", TypeError, "op: missing", lambda: dml.allreduce(b, f32)),
        ("root too large", ValueError, f"root: got {size}", lambda: dml.bcast(b, f32, root=size)),
        ("root negative", ValueError, "root: got -1", lambda: dml.reduce(b, f32, dml.SUM, root=-1)),
        ("root not an int", TypeError, "root: got 0.5", lambda: dml.bcast(b, f32, root=0.5)),
        ("shape mismatch", ValueError, "recvbuf: got shape (5,)", lambda: dml.allreduce(b, f32, np.zeros(5, np.float32), dml.SUM)),
        ("dtype mismatch", ValueError, "recvbuf: got dtype float64", lambda: dml.allreduce(b, f32, np.zeros(4), dml.SUM)),
        ("dtype mismatch bcast", ValueError, "dtype", lambda: dml.bcast(b, t32, torch.zeros(4, dtype=torch.int32))),
        ("non-contiguous numpy", ValueError, "non-contiguous", lambda: dml.allreduce(b, np.zeros(8, np.float32)[::2], dml.SUM)),
        ("non-contiguous torch", ValueError, "non-contiguous", lambda: dml.bcast(b, torch.zeros(4, 4).t())),
        ("non-contiguous recvbuf", ValueError, "recvbuf: a non-contiguous", lambda: dml.reduce(b, t32, torch.zeros(8)[::2], dml.SUM)),
        ("read-only result", ValueError, "read-only", lambda: dml.allreduce(b, ro, dml.MAX)),
        ("allgather wrong leading axis", ValueError, f"expected ({size}, 4)", lambda: dml.allgather(b, f32, np.zeros((size + 1, 4), np.float32))),
        ("allgather missing axis", ValueError, "recvbuf: got shape (4,)", lambda: dml.allgather(b, f32, np.zeros(4, np.float32))),
        ("overlapping buffers", ValueError, "overlap", lambda: dml.allreduce(b, f32[0:3], f32[1:4], dml.SUM)),
        ("overlapping, the send strided", ValueError, "overlap", lambda: dml.allreduce(b, sq.T, sq, dml.SUM)),
        ("overlapping torch, strided", ValueError, "overlap", lambda: dml.reduce(b, tsq.T, tsq, dml.SUM)),
        ("overlapping allgather, strided", ValueError, "overlap", lambda: dml.allgather(b, g32[0, ::2], g32)),
        ("masked array", TypeError, "MaskedArray, a subclass of numpy.ndarray", lambda: dml.allreduce(b, np.ma.masked_array(f32), dml.SUM)),
        ("matrix send", TypeError, "matrix, a subclass", lambda: dml.reduce_scatter(b, np.asmatrix(np.zeros((size, 2))), np.zeros(2), dml.SUM)),
        ("list buffer", TypeError, "allowed: numpy.ndarray, torch.Tensor (CPU or CUDA) or a CuPy array", lambda: dml.allreduce(b, [1.0, 2.0], dml.SUM)),
        ("scalar buffer", TypeError, "buf: got builtins.float", lambda: dml.bcast(b, 1.0)),
        ("complex dtype", TypeError, "complex128", lambda: dml.allreduce(b, np.zeros(2, complex), dml.SUM)),
        ("AVG on int", TypeError, "AVG needs a floating-point buffer, got dtype int32", lambda: dml.allreduce(b, np.zeros(3, np.int32), dml.AVG)),
        ("AVG on bool", TypeError, "dtype bool", lambda: dml.reduce(b, torch.zeros(3, dtype=torch.bool), "avg")),
        ("SUM on bool", TypeError, "bool buffers allow only", lambda: dml.allreduce(b, np.zeros(3, bool), dml.SUM)),
        ("backend missing", TypeError, "first argument must be a backend", lambda: dml.allreduce(f32, dml.SUM)),
        ("backend class", TypeError, "the class", lambda: dml.barrier(type(b))),
    ]  # fmt: skip


def bad_input_body(backend: dml.Backend, culprit: int) -> int:
    """Each bad call raises on rank ``culprit`` alone; then a good allreduce works everywhere.

    Were a bad call to send anything before raising, the good allreduce that follows
    would mismatch it and fail (or hang, which the runner's timeout turns into a failure).
    """
    size = dml.total_workers(backend)

    def good(name: str) -> None:
        buf = np.full(3, float(dml.local_rank(backend) + 1))
        dml.allreduce(backend, buf, dml.SUM)
        assert (buf == size * (size + 1) / 2).all(), f"after {name}: {buf}"

    return raise_alone(backend, culprit, bad_calls(backend), good)


def raise_alone(backend: dml.Backend, culprit: int, calls: list[Any], good: Callable[[str], None]) -> int:
    """Each ``(name, exception type, message fragment, call)`` of ``calls`` raises on rank ``culprit`` alone;
    after each one every rank runs ``good(name)``, a collective that checks its result. Returns how many."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    checked = 0
    for name, exc_type, fragment, call in calls:
        if rank == culprit % size:
            try:
                call()
            except exc_type as e:
                assert fragment in str(e), f"{name}: message {str(e)!r} lacks {fragment!r}"
            else:
                raise AssertionError(f"{name}: no {exc_type.__name__} raised")
        good(name)
        checked += 1
    return checked


# -- large and odd sizes (segmented reductions) ---------------------------------------------


def large_input(n: int, dtype: str, op: Any, rank: int) -> np.ndarray:
    """Cheap rank-dependent data whose reductions are exact in ``dtype``: element i is ``(i + rank) % 2 + 1`` for
    PROD, else ``(7 i + 3 rank) % 11``; made by repeating one period (a 64 MiB input in 0.01 s, not 0.9 s)."""
    i = np.arange(2 if resolve_op(op) is dml.PROD else 11, dtype=np.int64)
    period = (i + rank) % 2 + 1 if resolve_op(op) is dml.PROD else (i * 7 + rank * 3) % 11
    return np.tile(period.astype(dtype), -(-n // len(period)))[:n]


def large_body(backend: dml.Backend, n: int, dtype: str, op: Any, in_place: bool) -> None:
    """Reductions and data movement of ``n`` elements (sizes across segment boundaries)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    rop = resolve_op(op)
    mine = large_input(n, dtype, op, rank)
    if rop is dml.AVG:
        exp = sum(large_input(n, "float64", dml.SUM, r) for r in range(size)) / size
    elif rop is dml.SUM:
        exp = sum(large_input(n, "float64", dml.SUM, r) for r in range(size))
    else:
        ufunc = {dml.PROD: np.multiply, dml.MAX: np.maximum, dml.MIN: np.minimum}[rop]
        exp = large_input(n, "float64", op, 0)
        for r in range(1, size):
            exp = ufunc(exp, large_input(n, "float64", op, r))
    if in_place:
        out = dml.allreduce(backend, mine, op)
    else:
        out = dml.allreduce(backend, mine, np.empty_like(mine), op)
        np.testing.assert_array_equal(mine, large_input(n, dtype, op, rank))
    if rop is dml.AVG:
        np.testing.assert_allclose(out, exp, rtol=1e-6)
    else:
        np.testing.assert_array_equal(out, exp, err_msg=f"allreduce n={n} {dtype} {op}")
    root = n % size
    buf = large_input(n, dtype, op, rank)
    dml.reduce(backend, buf, op, root=root)
    if rank == root and rop is dml.AVG:
        np.testing.assert_allclose(buf, exp, rtol=1e-6, err_msg=f"reduce n={n} {dtype} {op}")
    elif rank == root:
        np.testing.assert_array_equal(buf, exp, err_msg=f"reduce n={n} {dtype} {op}")
    else:
        np.testing.assert_array_equal(buf, large_input(n, dtype, op, rank))
    buf = large_input(n, dtype, op, rank)
    dml.bcast(backend, buf, root=root)
    np.testing.assert_array_equal(buf, large_input(n, dtype, op, root), err_msg=f"bcast n={n}")


# -- mismatched collectives (debug mode) ------------------------------------------------------

MISMATCHES = ["shape", "dtype", "op", "root", "kind"]


def mismatch_body(backend: dml.Backend, case: str) -> bool:
    """Ranks call different collectives: every rank raises CollectiveMismatchError naming who called what,
    and the world stays usable. Needs a backend that checks (LocalBackend, or debug mode)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    odd = rank == size - 1  # the last rank differs
    calls = {
        "shape": (lambda: dml.allreduce(backend, np.zeros(3 if odd else 2), dml.SUM), "shape=(3,)"),
        "dtype": (lambda: dml.allreduce(backend, np.zeros(2, np.float32 if odd else np.float64), dml.SUM), "float32"),
        "op": (lambda: dml.allreduce(backend, np.zeros(2), dml.MAX if odd else dml.SUM), "op=dml.MAX"),
        "root": (lambda: dml.bcast(backend, np.zeros(2), root=1 if odd else 0), "root=1"),
        "kind": (lambda: dml.barrier(backend) if odd else dml.bcast(backend, np.zeros(1)), "called barrier()"),
    }
    call, fragment = calls[case]
    try:
        call()
    except dml.CollectiveMismatchError as e:
        assert fragment in str(e), f"{case}: {e}"
        assert f"rank(s) [{size - 1}] called" in str(e), str(e)
    else:
        raise AssertionError(f"{case}: no CollectiveMismatchError on rank {rank}")
    buf = np.ones(2)
    dml.allreduce(backend, buf, dml.SUM)
    assert (buf == size).all()
    return True


# -- tensors reused across calls ---------------------------------------------------------------


def _bits(x: Any) -> np.ndarray:
    """The raw bits of a float32/float64 tensor or array, for bitwise comparisons (NaN included)."""
    a = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64).copy()


def avg_values(rank: int, size: int, dtype: Any) -> torch.Tensor:
    """Rank-dependent values whose average is hard to get bitwise right: subnormals, sums that
    overflow or round, signed zeros, a NaN and infinities."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal
    v = [
        tiny / 8 * (rank + 1),  # subnormal inputs and quotients
        tiny * (rank + 3),  # a quotient that becomes subnormal
        info.max / 2 + info.max / 8 * rank,  # the sum overflows to inf on 3+ ranks
        1.0 / 3.0 * (rank + 1),  # a rounded sum and quotient
        -0.0,
        float("nan") if rank == 0 else 1.0,
        float("inf") if rank == size - 1 else -2.5,
        (rank + 1) * 0.1,
    ]
    return torch.tensor(v * 16, dtype=dtype)  # 128 elements


def tensor_views_body(backend: dml.Backend) -> int:
    """Collectives on the same tensors again and again (the library caches their NumPy views by
    address, shape and dtype): a tensor changed in place between calls (transposed, given a negative
    bit, another storage, reinterpreted as another dtype) is handled as what it is now; AVG is
    bitwise SUM then divide by the number of ranks, on every path. Returns how many checks ran."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    checks = 0
    m = torch.arange(9.0).reshape(3, 3) + rank
    expect = sum(torch.arange(9.0).reshape(3, 3) + r for r in range(size))
    for _ in range(3):  # the first call makes the view, the next ones reuse it
        m.copy_(torch.arange(9.0).reshape(3, 3) + rank)
        assert dml.allreduce(backend, m, dml.SUM) is m
        assert torch.equal(m, expect), m
    checks += 1
    m.t_()  # the same address, shape and dtype, now not contiguous
    with pytest.raises(ValueError, match="non-contiguous buffer of shape"):
        dml.allreduce(backend, m, dml.SUM)
    m.t_()
    neg = torch._neg_view(m)  # the same address, shape and dtype, with a negative bit
    with pytest.raises(ValueError, match="negative bit set"):
        dml.allreduce(backend, neg, dml.SUM)
    out = torch.empty(3, 3)
    dml.allreduce(backend, neg, out, dml.SUM)  # read as a source: its value
    assert torch.equal(out, -expect * size), out
    checks += 2
    other = torch.full((3, 3), float(rank))
    m.set_(other)  # another storage under the same tensor
    dml.allreduce(backend, m, dml.SUM)
    assert torch.equal(other, torch.full((3, 3), float(sum(range(size))))), other
    checks += 1
    f = torch.full((4,), float(rank + 1), dtype=torch.float64)
    dml.bcast(backend, f, root=size - 1)
    assert torch.equal(f, torch.full((4,), float(size), dtype=torch.float64)), f
    as_int = f.view(torch.int64)  # the same address and shape, another dtype: integer sums of the bits
    wrapped = as_int.numpy() * np.int64(size)
    dml.allreduce(backend, as_int, dml.SUM)
    assert np.array_equal(as_int.numpy(), wrapped), (as_int, wrapped)
    with pytest.raises(TypeError, match=r"dtype torch\.complex64 is not supported"):
        dml.allreduce(backend, f.view(torch.complex64), dml.SUM)
    flags = torch.tensor([rank == 0, False, True])
    for _ in range(2):
        dml.allreduce(backend, flags, dml.MAX)
    assert flags.tolist() == [True, False, True], flags
    empty = torch.empty(0, 3)
    for _ in range(2):
        dml.allreduce(backend, empty, dml.SUM)
    gathered = torch.empty(size, 4, dtype=torch.float64)
    for _ in range(2):
        dml.allgather(backend, torch.full((4,), float(rank), dtype=torch.float64), gathered)
        assert gathered[:, 0].tolist() == [float(r) for r in range(size)], gathered
    checks += 5
    root = size - 1
    forms = {
        "in place": lambda x, op: dml.allreduce(backend, x, op),
        "two buffers": lambda x, op: dml.allreduce(backend, x.clone(), x, op),
        "reduce": lambda x, op: dml.reduce(backend, x, op, root=root),
    }
    for dtype in (torch.float32, torch.float64):
        inputs = avg_values(rank, size, dtype)
        for form, call in forms.items():  # each form's own SUM: the reduction order may differ between forms
            sums = inputs.clone()
            with np.errstate(over="ignore"):
                call(sums, dml.SUM)
            expect = _bits(np.divide(sums.numpy(), size)) if form != "reduce" or rank == root else _bits(inputs)
            buf = inputs.clone()
            for _ in range(2):  # twice on the same tensor
                buf.copy_(inputs)
                with np.errstate(over="ignore"):  # LocalBackend's NumPy sums overflow to inf, as they should
                    call(buf, dml.AVG)
                assert np.array_equal(_bits(buf), expect), (form, dtype, buf[:8], sums[:8])
            checks += 1
    return checks
