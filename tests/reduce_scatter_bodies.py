"""Bodies of the reduce_scatter tests, run on LocalBackend.spawn (tests/test_reduce_scatter.py) and under
mpiexec (tests/reduce_scatter_job.py).

A :class:`bodies.Case` describes one rank's result: ``case.shape`` is the row shape, and every
rank's ``sendbuf`` has the shape ``(W, *case.shape)``. Inputs and expected results come from
tests/bodies.py (``values`` of the case widened to the full send shape), so every rank can
rebuild every other rank's input without communication.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np
import torch

import distutils_ml as dml
from distutils_ml.backends.base import resolve_op

from bodies import Case, as_float64, assert_reduced, assert_same, make, matrix_cases, raise_alone, sendbuf, values

#: The matrix of reduce_scatter: every (op, dtype) allreduce allows x in place / two buffers / strided
#: sendbuf x the row shapes (), (2, 0, 3), (3, 7), with kinds and spellings rotating (bodies.matrix_cases).
MATRIX = matrix_cases("allreduce")


def full_case(case: Case, size: int) -> Case:
    """The case of one rank's whole ``sendbuf``: the row shape with a leading axis of ``size``."""
    return dataclasses.replace(case, shape=(size, *case.shape))


def _address(x: Any) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


def reduce_scatter_body(backend: dml.Backend, case: Case) -> np.ndarray:
    """Rank r receives the op over ranks of every rank's ``sendbuf[r]``; the two-buffer form leaves ``sendbuf``
    alone, the in-place form returns the view ``buf[rank]`` and leaves the other rows unchanged."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    full = full_case(case, size)
    inputs = [values(full, r, size) for r in range(size)]
    if case.in_place:
        buf = make(full, inputs[rank])
        out = dml.reduce_scatter(backend, buf, case.op)
        assert tuple(out.shape) == case.shape, (out.shape, case)
        assert type(out) is type(buf) and _address(out) == _address(buf[rank, ...]), "not a view of buf[rank]"
        for k in range(size):
            if k != rank:
                assert_same(buf[k, ...], inputs[rank][k], f"reduce_scatter in place changed row {k}: {case}")
    else:
        send = sendbuf(full, inputs[rank])
        recv = make(case, np.zeros(case.shape))
        out = dml.reduce_scatter(backend, send, recv, case.op)
        assert out is recv
        assert_same(send, inputs[rank], "reduce_scatter changed sendbuf")
    assert_reduced(case, out, [inputs[r][rank] for r in range(size)])
    return as_float64(out)


def matrix_body(backend: dml.Backend) -> int:
    """Every case of :data:`MATRIX` in one body; returns how many ran."""
    for i, case in enumerate(MATRIX):
        try:
            reduce_scatter_body(backend, case)
        except AssertionError as e:
            raise AssertionError(f"case {i} on {dml.total_workers(backend)} ranks, {case}: {e}") from None
    return len(MATRIX)


def mixed_forms_body(backend: dml.Backend, seed: int) -> int:
    """Ranks may mix the in-place and two-buffer forms in one call (as with allreduce)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    count = 0
    for dtype, op in (("float64", dml.SUM), ("int32", dml.MAX), ("float32", dml.AVG), ("bfloat16", dml.MIN)):
        for parity in (0, 1):
            case = Case((4, 3), dtype, "torch" if dtype == "bfloat16" else "numpy", op, 0, False, False, seed + count)
            inputs = [values(full_case(case, size), r, size) for r in range(size)]
            buf = make(full_case(case, size), inputs[rank])
            recv = () if rank % 2 == parity else (make(case, np.zeros(case.shape)),)
            out = dml.reduce_scatter(backend, buf, *recv, op)  # one line: debug mode compares call sites
            assert_reduced(case, out, [inputs[r][rank] for r in range(size)])
            count += 1
    return count


def sharding_body(backend: dml.Backend, n: int) -> int:
    """The sharding idiom on flat buffers: ``G.view(W, n)`` / ``G.reshape(W, n)`` are zero-copy views
    that reduce_scatter and allgather take; reduce_scatter then allgather equals allreduce."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    checks = 0
    for kind, dtype in (("torch", "float32"), ("numpy", "float64"), ("numpy", "int64"), ("torch", "bfloat16")):
        case = Case((size * n,), dtype, kind, dml.SUM, 0, False, False, 7 + checks)
        inputs = [values(case, r, size) for r in range(size)]
        flat = make(case, inputs[rank])
        rows = flat.view(size, n) if kind == "torch" else flat.reshape(size, n)
        assert _address(rows) == _address(flat) and (kind == "torch" or np.shares_memory(rows, flat)), "a copy"
        shard = make(case, np.zeros(n))
        dml.reduce_scatter(backend, rows, shard, dml.SUM)
        gathered = make(case, np.zeros(size * n))
        into = gathered.view(size, n) if kind == "torch" else gathered.reshape(size, n)
        assert dml.allgather(backend, shard, into) is into
        total = dml.allreduce(backend, flat, dml.SUM)
        # Integers and the rank-order sums of LocalBackend agree bitwise; MPI may sum in another order.
        row_case = dataclasses.replace(case, shape=(n,))
        for k in range(size):
            assert_reduced(
                row_case, gathered[k * n : (k + 1) * n], [inputs[r][k * n : (k + 1) * n] for r in range(size)]
            )
        if dtype == "int64" or isinstance(backend, dml.LocalBackend):
            assert_same(gathered, as_float64(total), f"allgather(reduce_scatter(x)) != allreduce(x): {case}")
        # In place on the flat buffer itself: this rank's shard of it is the result.
        flat = make(case, inputs[rank])
        mine = dml.reduce_scatter(backend, flat.view(size, n) if kind == "torch" else flat.reshape(size, n), dml.SUM)
        assert_same(mine, as_float64(shard), "in place on a view of a flat buffer")
        assert_same(flat[rank * n : (rank + 1) * n], as_float64(shard), "the result is not in the flat buffer")
        checks += 1
    return checks


def large_body(backend: dml.Backend, n: int, dtype: str, op: Any, in_place: bool) -> None:
    """``n`` elements per row: sizes across segment boundaries (the packed, segmented path on MPI)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    rop = resolve_op(op)

    def data(r: int, as_dtype: str) -> np.ndarray:  # element i of the flat rows: (7 i + 3 r) % 11, a period repeated
        period = ((np.arange(11, dtype=np.int64) * 7 + r * 3) % 11).astype(as_dtype)
        return np.tile(period, -(-size * n // 11))[: size * n].reshape(size, n)

    ufunc = {dml.SUM: np.add, dml.AVG: np.add, dml.MAX: np.maximum, dml.MIN: np.minimum}[rop]
    exp = data(0, "float64")[rank]
    for r in range(1, size):
        exp = ufunc(exp, data(r, "float64")[rank])
    if rop is dml.AVG:
        exp = exp / size
    mine = data(rank, dtype)
    if in_place:
        out = dml.reduce_scatter(backend, mine, op)
        rest = np.delete(mine, rank, axis=0)
        np.testing.assert_array_equal(rest, np.delete(data(rank, dtype), rank, axis=0), "other rows changed")
    else:
        out = dml.reduce_scatter(backend, mine, np.empty(n, dtype), op)
        np.testing.assert_array_equal(mine, data(rank, dtype), "sendbuf changed")
    if rop is dml.AVG:
        np.testing.assert_allclose(out, exp, rtol=1e-6, err_msg=f"n={n} {dtype} {op}")
    else:
        np.testing.assert_array_equal(out, exp, err_msg=f"n={n} {dtype} {op}")


# -- bad input ---------------------------------------------------------------------------


def bad_calls(backend: dml.Backend) -> list[tuple[str, type[Exception], str, Any]]:
    """(name, exception type, message fragment, call) for every documented bad input of reduce_scatter."""
    w = dml.total_workers(backend)
    b = backend
    rows = np.zeros((w, 4), np.float32)
    trows = torch.zeros(w, 4)
    row = np.zeros(4, np.float32)
    ro = np.zeros((w, 4), np.float32)
    ro.flags.writeable = False
    rs = dml.reduce_scatter
    return [
        ("flat sendbuf", ValueError, f"a flat buffer; reduce_scatter needs a leading axis of size total_workers ({w})", lambda: rs(b, np.zeros(4 * w, np.float32), row, dml.SUM)),  # noqa: E501
        ("flat sendbuf names the view", ValueError, f"sendbuf.view({w}, -1) (torch) or sendbuf.reshape({w}, -1)", lambda: rs(b, torch.zeros(4 * w), torch.zeros(4), dml.SUM)),  # noqa: E501
        ("flat in place", ValueError, f"buf: got shape ({4 * w},), a flat buffer", lambda: rs(b, torch.zeros(4 * w), dml.AVG)),  # noqa: E501
        ("wrong leading axis", ValueError, f"sendbuf: got shape ({w + 1}, 4); reduce_scatter needs", lambda: rs(b, np.zeros((w + 1, 4), np.float32), row, dml.SUM)),  # noqa: E501
        ("0-d sendbuf", ValueError, "buf: got a 0-d buffer", lambda: rs(b, np.zeros((), np.float32), dml.SUM)),
        ("recvbuf shape", ValueError, f"recvbuf: got shape (5,), expected (4,) (from sendbuf ({w}, 4))", lambda: rs(b, rows, np.zeros(5, np.float32), dml.SUM)),  # noqa: E501
        ("recvbuf shaped like sendbuf", ValueError, f"recvbuf: got shape ({w}, 4), expected (4,)", lambda: rs(b, rows, np.zeros((w, 4), np.float32), dml.SUM)),  # noqa: E501
        ("recvbuf dtype", ValueError, "recvbuf: got dtype float64, expected sendbuf's dtype float32", lambda: rs(b, rows, np.zeros(4), dml.SUM)),  # noqa: E501
        ("one buffer twice", ValueError, "same buffer; for the in-place form pass it once", lambda: rs(b, trows, trows, dml.SUM)),  # noqa: E501
        ("recvbuf inside sendbuf", ValueError, "overlap", lambda: rs(b, rows, rows[w - 1], dml.SUM)),
        ("non-contiguous buf", ValueError, "buf: a non-contiguous", lambda: rs(b, torch.zeros(4, w + 1).t()[:w], dml.SUM)),  # noqa: E501
        ("non-contiguous recvbuf", ValueError, "recvbuf: a non-contiguous", lambda: rs(b, trows, torch.zeros(8)[::2], dml.SUM)),  # noqa: E501
        ("read-only buf", ValueError, "read-only", lambda: rs(b, ro, dml.MAX)),
        ("AVG on int", TypeError, "AVG needs a floating-point buffer, got dtype int32", lambda: rs(b, np.zeros((w, 2), np.int32), dml.AVG)),  # noqa: E501
        ("SUM on bool", TypeError, "bool buffers allow only", lambda: rs(b, torch.zeros(w, 2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool), "sum")),  # noqa: E501
        ("unknown op", ValueError, "op: got", lambda: rs(b, rows, row, operator.sub)),
        ("missing op", TypeError, "op: missing", lambda: rs(b, rows)),
        ("list buffer", TypeError, "allowed: numpy.ndarray, torch.Tensor (CPU or CUDA) or a CuPy array", lambda: rs(b, [[1.0]] * w, dml.SUM)),  # noqa: E501
        ("complex dtype", TypeError, "complex128", lambda: rs(b, np.zeros((w, 2), complex), dml.SUM)),
        ("backend missing", TypeError, "first argument must be a backend", lambda: rs(rows, row, dml.SUM)),
    ]  # fmt: skip


def bad_input_body(backend: dml.Backend, culprit: int) -> int:
    """Each bad call raises on rank ``culprit`` alone; then a good reduce_scatter works everywhere.

    Were a bad call to send anything before raising, the good call that follows would
    mismatch it and fail (or hang, which the runner's timeout turns into a failure).
    """
    size = dml.total_workers(backend)

    def good(name: str) -> None:
        buf = np.full((size, 3), float(dml.local_rank(backend) + 1))
        out = dml.reduce_scatter(backend, buf, dml.SUM)
        assert (out == size * (size + 1) / 2).all(), f"after {name}: {out}"

    return raise_alone(backend, culprit, bad_calls(backend), good)


# -- mismatched collectives (debug mode) ------------------------------------------------------

MISMATCHES = ["shape", "dtype", "op", "kind"]


def mismatch_body(backend: dml.Backend, case: str) -> bool:
    """Ranks call different collectives: every rank raises CollectiveMismatchError naming reduce_scatter and
    who called what, and the world stays usable. Needs a backend that checks (LocalBackend, or debug mode)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    odd = rank == size - 1  # the last rank differs
    rs = dml.reduce_scatter
    calls = {
        "shape": (lambda: rs(backend, np.zeros((size, 3 if odd else 2)), dml.SUM), f"shape=({size}, 3)"),
        "dtype": (lambda: rs(backend, np.zeros((size, 2), np.float32 if odd else np.float64), dml.SUM), "float32"),
        "op": (lambda: rs(backend, np.zeros((size, 2)), dml.MAX if odd else dml.AVG), "op=dml.MAX"),
        "kind": (
            lambda: (dml.allreduce if odd else rs)(backend, np.zeros((size, 2)), dml.SUM),
            "called reduce_scatter(",
        ),
    }
    call, fragment = calls[case]
    try:
        call()
    except dml.CollectiveMismatchError as e:
        assert fragment in str(e), f"{case}: {e}"
        assert f"rank(s) [{size - 1}] called" in str(e), str(e)
    else:
        raise AssertionError(f"{case}: no CollectiveMismatchError on rank {rank}")
    out = dml.reduce_scatter(backend, np.ones((size, 2)), dml.SUM)
    assert (out == size).all()
    return True
