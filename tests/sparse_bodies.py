"""Bodies of ``dml.sparse_allreduce``, run on LocalBackend.spawn (tests/test_sparse.py) and under mpiexec
(tests/sparse_job.py). Each takes ``(backend, case)`` on every rank and asserts.

Every rank rebuilds every rank's input from the case's seed, so the expected result is computed
locally: the sum, in float64, of each rank's ``tensor.coalesce()`` as a dense array, and the union of
their indices. Exact inputs (small integers as floats) sum exactly in every dtype, so SUM is compared
bitwise; AVG within one rounding of the quotient. Inexact inputs (float32/float64 only) are compared
within the error bound of a summation.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.backends.base import resolve_op

from bodies import raise_alone

DTYPES = ("float32", "float64", "float16", "bfloat16")
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
#: Unit roundoff of each dtype.
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
SPELLINGS = {dml.SUM: (dml.SUM, "sum", operator.add), dml.AVG: (dml.AVG, "avg")}
#: Named layouts (sparse sizes, dense sizes): what the deterministic matrix covers.
KINDS = {
    "1-D": ((7,), ()),
    "2-D": ((4, 5), ()),
    "hybrid": ((9,), (3,)),  # nn.Embedding(sparse=True)'s gradient: indices (1, nnz), values (nnz, 3)
    "3-D hybrid": ((3, 2, 2), (2, 2)),
    "empty rows": ((5,), (0,)),  # value rows of no bytes
}


@dataclass(frozen=True)
class SparseCase:
    """One call: every rank's tensor has ``sparse`` x ``dense`` shape; rank r's entries come from (seed, r)."""

    sparse: tuple[int, ...]  # the sparse dimensions' sizes (each >= 1)
    dense: tuple[int, ...]  # the dense trailing dimensions' sizes
    dtype: str
    op: Any  # an accepted spelling of dml.SUM or dml.AVG
    max_nnz: int  # a rank's entries, before duplicates: 0..max_nnz
    empty_rank: int | None  # this rank (mod world size) has no entry at all
    duplicates: bool  # repeat some entries' indices with other values (an uncoalesced input)
    coalesced: bool  # pass the tensor coalesced (the result must still be a new tensor)
    exact: bool  # small integers (sums exact in every dtype) or uniform reals (float32/float64 only)
    seed: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sparse + self.dense


@st.composite
def sparse_cases(draw: st.DrawFn, dtype: str | None = None) -> SparseCase:
    """A random call: layout (1-D, 2-D, hybrid, any of up to 3 sparse and 2 dense dimensions), dtype, op and
    spelling, entries per rank (none included), duplicates, and exact or inexact values."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):
        sparse, dense = draw(st.sampled_from(list(KINDS.values())))
    else:
        sparse = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        dense = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    op = draw(st.sampled_from(SPELLINGS[draw(st.sampled_from((dml.SUM, dml.AVG)))]))
    return SparseCase(
        sparse=sparse,
        dense=dense,
        dtype=dtype,
        op=op,
        max_nnz=draw(st.integers(0, 12)),
        empty_rank=draw(st.none() | st.integers(0, 4)),
        duplicates=draw(st.booleans()),
        coalesced=draw(st.booleans()),
        exact=dtype in ("float16", "bfloat16") or draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def matrix_cases() -> list[SparseCase]:
    """Every layout x dtype x op, with duplicates and an empty rank, then without; inexact values too."""
    out = []
    for (sparse, dense), dtype, op in zip_product(KINDS.values(), DTYPES, SPELLINGS):
        for duplicates in (True, False):
            i = len(out)
            out.append(
                SparseCase(
                    sparse,
                    dense,
                    dtype,
                    SPELLINGS[op][i % len(SPELLINGS[op])],
                    max_nnz=6,
                    empty_rank=i if duplicates else None,
                    duplicates=duplicates,
                    coalesced=not duplicates and i % 3 == 0,
                    exact=dtype in ("float16", "bfloat16") or duplicates,
                    seed=i,
                )
            )
    return out


def zip_product(*groups: Any) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    for group in groups:
        out = [(*head, item) for head in out for item in group]
    return out


# -- inputs and expected results ---------------------------------------------------------------


@lru_cache(maxsize=512)  # every rank rebuilds every rank's input: on LocalBackend.spawn, once for all
def entries(case: SparseCase, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s (indices (sparse_dim, nnz) int64, values (nnz, *dense) float64), uncoalesced, read-only."""
    rng = np.random.default_rng([case.seed, rank])
    nnz = (
        0 if case.empty_rank is not None and rank == case.empty_rank % size else int(rng.integers(0, case.max_nnz + 1))
    )
    indices = np.stack([rng.integers(0, n, nnz) for n in case.sparse]).reshape(len(case.sparse), nnz)
    if case.duplicates and nnz:
        again = rng.integers(0, nnz, int(rng.integers(1, nnz + 1)))
        indices = np.concatenate([indices, indices[:, again]], axis=1)
        rng.shuffle(indices, axis=1)
    shape = (indices.shape[1], *case.dense)
    values = rng.integers(-4, 5, shape).astype(np.float64) if case.exact else rng.uniform(-10.0, 10.0, shape)
    values = torch.from_numpy(values).to(TORCH[case.dtype]).to(torch.float64).numpy()  # exact in the dtype
    indices.flags.writeable = values.flags.writeable = False
    return indices, values


def make(case: SparseCase, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: uncoalesced (or coalesced where the case says so), in the case's dtype."""
    indices, values = entries(case, rank, size)
    t = torch.sparse_coo_tensor(
        torch.from_numpy(indices.copy()),
        torch.from_numpy(values.copy()).to(TORCH[case.dtype]),
        case.shape,
        check_invariants=True,
    )
    return t.coalesce() if case.coalesced else t


def as_float64(t: torch.Tensor) -> np.ndarray:
    return t.to_dense().to(torch.float64).numpy()


def expected(case: SparseCase, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(the result's indices, sorted; the float64 sum of every rank's coalesced tensor, dense; the float64 sum
    of their |values|, dense; how many entries of any rank were summed in all)."""
    total, magnitude = np.zeros(case.shape), np.zeros(case.shape)
    linear: list[np.ndarray] = []
    terms = 0
    for r in range(size):
        t = make(case, r, size).coalesce()  # a rank's duplicates, summed in its dtype (exact for exact inputs)
        total += as_float64(t)
        magnitude += np.abs(as_float64(t))
        indices, _ = entries(case, r, size)
        terms += indices.shape[1]
        linear.append(np.ravel_multi_index(tuple(t.indices().numpy()), case.sparse) if t.indices().numel() else [])
    union = np.unique(np.concatenate([np.asarray(x, dtype=np.int64) for x in linear]))
    return np.stack(np.unravel_index(union, case.sparse)).reshape(len(case.sparse), -1), total, magnitude, terms


def check_result(case: SparseCase, got: torch.Tensor, size: int) -> None:
    """``got`` is the case's reduction: layout, coalesced, dtype, shape, indices, values."""
    what = f"{case} on {size} ranks"
    assert got.layout is torch.sparse_coo and got.is_coalesced(), (what, got.layout)
    assert got.dtype == TORCH[case.dtype] and tuple(got.shape) == case.shape and got.device.type == "cpu", (what, got)
    assert got.sparse_dim() == len(case.sparse) and got.dense_dim() == len(case.dense), what
    indices, total, magnitude, terms = expected(case, size)
    np.testing.assert_array_equal(got.indices().numpy(), indices, err_msg=f"indices: {what}")
    g = as_float64(got)
    op = resolve_op(case.op)
    if op is dml.AVG:
        total, magnitude = total / size, magnitude / size
    if case.exact and op is dml.SUM:
        np.testing.assert_array_equal(g, total, err_msg=f"values: {what}")
        return
    # Exact: the sum divided and rounded (twice for float16/bfloat16: in float32, then to the dtype). Otherwise
    # float32/float64 sums of `terms` values, then one division.
    bound = 2 * UNIT[case.dtype] * np.abs(total) if case.exact else (terms + 2) * UNIT[case.dtype] * magnitude
    bad = np.abs(g - total) > bound
    assert not bad.any(), f"values: {what}: got {g[bad][:5]}, expected {total[bad][:5]}"


# -- bodies ---------------------------------------------------------------------------------------------


def sparse_body(backend: dml.Backend, case: SparseCase) -> bytes:
    """sparse_allreduce equals the reduction of every rank's input; the input is unchanged, the result new.
    Returns the result's bytes (indices, values), for a bitwise comparison across ranks."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    t = make(case, rank, size)
    before = as_float64(t)
    got = dml.sparse_allreduce(backend, t, case.op)
    assert got is not t, case
    if case.coalesced and t.values().numel():
        assert got.values().data_ptr() != t.values().data_ptr(), f"the result shares the input's values: {case}"
    np.testing.assert_array_equal(as_float64(t), before, err_msg=f"the input changed: {case}")
    check_result(case, got, size)
    values = got.values().view(torch.int16) if case.dtype == "bfloat16" else got.values()
    return got.indices().numpy().tobytes() + values.numpy().tobytes()


def matrix_body(backend: dml.Backend) -> int:
    """Every case of :func:`matrix_cases` in one body; returns how many ran."""
    for case in matrix_cases():
        sparse_body(backend, case)
    return len(matrix_cases())


def embedding_body(backend: dml.Backend, steps: int) -> int:
    """nn.Embedding(sparse=True) gradients of different lookups per rank: sparse_allreduce(AVG) is, densified,
    dml.allreduce(AVG) of the dense gradients. Returns how many gradients were compared."""
    rank = dml.local_rank(backend)
    table = torch.nn.Embedding(50, 4, sparse=True)
    dense = torch.nn.Embedding(50, 4)
    with torch.no_grad():
        table.weight.copy_(torch.arange(200.0).reshape(50, 4) / 8)
        dense.weight.copy_(table.weight)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        lookups = torch.randint(0, 50, (3 + rank, 5), generator=g)  # repeats within a rank, overlaps across ranks
        for model in (table, dense):
            model.zero_grad()
            model(lookups).pow(2).sum().backward()
        sparse_grad = table.weight.grad
        assert sparse_grad.is_sparse and not sparse_grad.is_coalesced()
        got = dml.sparse_allreduce(backend, sparse_grad)
        want = dml.allreduce(backend, dense.weight.grad.clone(), dml.AVG)
        np.testing.assert_allclose(got.to_dense().numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
        assert set(got.indices()[0].tolist()) <= set(range(50))
    return steps


# -- bad input, mismatches, debug mode ------------------------------------------------------------


def _sparse(shape: tuple[int, ...] = (4,), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One entry, at the origin: every dimension sparse."""
    indices = torch.zeros((len(shape), 1), dtype=torch.int64)
    return torch.sparse_coo_tensor(indices, torch.ones(1, dtype=dtype), shape, check_invariants=True)


# Tensors whose indices lie outside their shape, made once, here: torch's check_invariants is a process-wide
# switch, so a simulated rank building a checked tensor at the same time would have these checked (and refused).
PAST_END = torch.sparse_coo_tensor([[0, 4]], [1.0, 2.0], (4,), check_invariants=False)
NEGATIVE = torch.sparse_coo_tensor([[0], [-1]], [1.0], (2, 3), check_invariants=False)


def bad_calls(backend: dml.Backend) -> list[tuple[str, type[Exception], str, Callable[[], Any]]]:
    """(name, exception type, message fragment, call) for every documented bad input of sparse_allreduce."""

    def call(*args: Any) -> Callable[[], Any]:
        return lambda: dml.sparse_allreduce(backend, *args)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR tensors warn that they are beta
        csr = torch.eye(3).to_sparse_csr()
    return [
        ("dense tensor", TypeError, "tensor: got a dense (strided) tensor of shape (4,)", call(torch.ones(4))),
        ("csr tensor", TypeError, "tensor: got a sparse_csr tensor", call(csr)),
        ("numpy array", TypeError, "tensor: got numpy.ndarray", call(np.ones(3))),
        ("list", TypeError, "tensor: got builtins.list", call([1.0])),
        ("int64 dtype", TypeError, "tensor: got dtype torch.int64", call(_sparse(dtype=torch.int64))),
        ("int32 dtype", TypeError, "dtype torch.int32", call(_sparse(dtype=torch.int32), dml.SUM)),
        ("bool dtype", TypeError, "dtype torch.bool", call(_sparse(dtype=torch.bool), dml.SUM)),
        ("complex dtype", TypeError, "dtype torch.complex64", call(_sparse(dtype=torch.complex64))),
        ("meta device", TypeError, "on device 'meta'", call(_sparse().to("meta"))),
        ("op MAX", ValueError, "op: got dml.MAX; allowed: dml.SUM or dml.AVG", call(_sparse(), dml.MAX)),
        ("op min", ValueError, "op: got dml.MIN", call(_sparse(), min)),
        ("op PROD", ValueError, "op: got dml.PROD", call(_sparse(), "prod")),
        ("unknown op", ValueError, "op: got 'mean'", call(_sparse(), "mean")),
        ("index past the end", ValueError, "indices from 0 to 4, outside 0..3 of shape (4,)", call(PAST_END)),
        ("negative index", ValueError, "sparse dimension 1 has indices from -1 to -1", call(NEGATIVE)),
        (
            "backend missing",
            TypeError,
            "first argument must be a backend",
            lambda: dml.sparse_allreduce(_sparse(), dml.SUM),
        ),
    ]


def _good(backend: dml.Backend, name: str) -> None:
    """A sparse_allreduce every rank makes after a bad call: had the bad call sent anything, this one mismatches."""
    size = dml.total_workers(backend)
    rank = dml.local_rank(backend)
    t = torch.sparse_coo_tensor([[rank % 3]], [float(rank + 1)], (3,), check_invariants=True)
    got = dml.sparse_allreduce(backend, t, dml.SUM).to_dense()
    want = [float(sum(r + 1 for r in range(size) if r % 3 == i)) for i in range(3)]
    assert got.tolist() == want, f"after {name}: {got}"


def bad_input_body(backend: dml.Backend, culprit: int) -> int:
    """Each bad call raises on rank ``culprit`` alone, before sending anything; the world goes on."""
    return raise_alone(backend, culprit, bad_calls(backend), lambda name: _good(backend, name))


#: How the last rank's call differs from the others' (each passes ``_sparse((4, 1))``, sparse_dim 2, with dml.AVG),
#: and what the error then says of it.
MISMATCHES = {
    "shape": (lambda: _sparse((5, 1)), dml.AVG, "shape (5, 1)"),
    "dtype": (lambda: _sparse((4, 1), torch.float64), dml.AVG, "dtype float64"),
    "sparse_dim": (
        lambda: torch.sparse_coo_tensor([[0]], torch.ones(1, 1), (4, 1), check_invariants=True),
        dml.AVG,
        "sparse_dim 1",
    ),
    "op": (lambda: _sparse((4, 1)), dml.SUM, "op dml.SUM"),
}


def mismatch_body(backend: dml.Backend, case: str) -> str:
    """The last rank's tensor (or op) differs: every rank raises the same ValueError naming both calls, before
    any entry moves; the world goes on. Returns the message."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    other, other_op, fragment = MISMATCHES[case]
    t, op = (other(), other_op) if rank == size - 1 else (_sparse((4, 1)), dml.AVG)
    with pytest.raises(ValueError, match="sparse_allreduce: the ranks' calls differ") as info:
        dml.sparse_allreduce(backend, t, op)
    text = str(info.value)
    assert f"rank(s) [{size - 1}]: " in text and fragment in text, text
    assert f"rank(s) {list(range(size - 1))}: shape (4, 1), dtype float32, sparse_dim 2" in text, text
    _good(backend, f"mismatch {case}")
    return text


def debug_body(backend: dml.Backend, case: SparseCase) -> bool:
    """In debug mode a correct call goes through, and a rank calling another collective meanwhile is named (the
    first collective sparse_allreduce makes is an allgather of each rank's entry count and call digest)."""
    sparse_body(backend, case)
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    if size == 1:
        return True
    with pytest.raises(dml.CollectiveMismatchError) as info:
        if rank == 0:
            dml.allreduce(backend, np.zeros(2), dml.SUM)
        else:
            dml.sparse_allreduce(backend, _sparse())
    text = str(info.value)
    assert "rank(s) [0] called allreduce(shape=(2,)" in text, text
    assert f"rank(s) {list(range(1, size))} called allgather(shape=(2,), dtype=int64)" in text, text
    _good(backend, "debug")
    return True
