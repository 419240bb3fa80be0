"""Bodies for the object collectives, run on LocalBackend.spawn (tests/test_objects.py) and under
mpiexec (tests/core_job.py). Each takes the backend and asserts; every failure must be raised on
every rank, after which the world must still work."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import bodies


def _world_still_works(backend: dml.Backend) -> None:
    buf = np.ones(3)
    dml.allreduce(backend, buf, dml.SUM)
    assert (buf == backend.size).all(), buf


def values(backend: dml.Backend) -> None:
    rank, size = backend.rank, backend.size
    for root in range(size):
        mine = {"rank": rank, "t": torch.arange(3) * rank, "s": "x" * rank, "n": None, "f": 0.5}
        got = dml.bcast_object(backend, mine, root=root)
        if rank == root:
            assert got is mine
        assert got["rank"] == root and got["s"] == "x" * root and torch.equal(got["t"], torch.arange(3) * root)
    everyone = dml.allgather_object(backend, ("r", rank, [rank] * rank))
    assert everyone == [("r", r, [r] * r) for r in range(size)], everyone
    assert dml.bcast_object(backend, b"", root=size - 1) == b""
    assert dml.allgather_object(backend, None) == [None] * size


class _OnlyOnRoot:
    """Pickles on every rank, but unpickles on the root only (as a class defined in root's __main__ would)."""

    def __init__(self, root: int) -> None:
        self.root = root

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[int]]:
        return _rebuild_on_root, (self.root,)


def _rebuild_on_root(root: int) -> _OnlyOnRoot:
    rank = dml.local_rank(_current_backend())
    if rank != root:
        raise AttributeError(f"Can't get attribute 'OnlyOnRoot' on <module '__main__'> (rank {rank})")
    return _OnlyOnRoot(root)


def _current_backend() -> dml.Backend:
    backend = dml.get_distributed_backend(dml.LocalBackend) if dml.initialized(dml.LocalBackend) else None
    if backend is not None and backend.size > 1:
        return backend
    return dml.get_distributed_backend(dml.MPIBackend)


def failures(backend: dml.Backend) -> None:
    rank, size = backend.rank, backend.size
    root = size - 1
    # Root's value cannot be pickled: the same error class on every rank.
    with pytest.raises(TypeError, match=rf"bcast_object: the object of rank {root} cannot be pickled: TypeError"):
        dml.bcast_object(backend, threading.Lock() if rank == root else None, root=root)
    _world_still_works(backend)
    # Some ranks cannot unpickle root's value: every rank raises, naming them.
    if size > 1:
        with pytest.raises(RuntimeError, match=r"could not unpickle") as info:
            dml.bcast_object(backend, _OnlyOnRoot(root) if rank == root else None, root=root)
        assert f"rank(s) {[r for r in range(size) if r != root]}" in str(info.value), info.value
        _world_still_works(backend)
    # One rank's value cannot be pickled in an allgather.
    culprit = 1 % size
    with pytest.raises(TypeError, match=rf"allgather_object: the object of rank {culprit} cannot be pickled"):
        dml.allgather_object(backend, threading.Lock() if rank == culprit else rank)
    _world_still_works(backend)
    # run_on_root: root's error, raised on every rank with its class; the value otherwise.
    from distutils_ml.objects import run_on_root

    def fails() -> None:
        raise FileNotFoundError("no such checkpoint: /nowhere")

    with pytest.raises(FileNotFoundError, match=rf"reading: rank {root}: FileNotFoundError: no such checkpoint"):
        run_on_root(backend, fails if rank == root else lambda: None, root=root, what="reading")
    assert run_on_root(backend, lambda: {"answer": 42}, root=root) == {"answer": 42}
    with pytest.raises(RuntimeError, match=r"custom: rank 0: KeyboardInterruptLike: stop"):

        class KeyboardInterruptLike(Exception):  # not a builtin: RuntimeError everywhere
            pass

        def custom() -> None:
            raise KeyboardInterruptLike("stop")

        run_on_root(backend, custom, root=0, what="custom")
    _world_still_works(backend)
    # Bad arguments raise before anything is sent.
    with pytest.raises(ValueError, match="root: got"):
        dml.bcast_object(backend, 1, root=size)
    with pytest.raises(TypeError, match="backend instance"):
        dml.allgather_object(dml.MPIBackend, 1)
    _world_still_works(backend)


def large_pickle(backend: dml.Backend) -> None:
    """An object pickling to several MiB goes through unchanged (the pieces path on a tiny piece size)."""
    rank = backend.rank
    arr = np.random.default_rng(3).standard_normal(1 << 20)
    got = dml.bcast_object(backend, {"a": arr} if rank == 0 else None)
    assert np.array_equal(got["a"], arr)
    parts = dml.allgather_object(backend, arr[: 1000 * (rank + 1)])
    assert [len(p) for p in parts] == [1000 * (r + 1) for r in range(backend.size)]
    assert pickle.dumps(parts[-1]) == pickle.dumps(arr[: 1000 * backend.size])


def duplicate(backend: dml.Backend) -> None:
    """backend.duplicate(): the same ranks over a communicator of their own, so a second thread's collectives on it
    run while the first thread's run on the original, and neither pairs up with the other's."""
    dup = backend.duplicate()
    assert dup is not backend and type(dup) is type(backend), dup
    assert (dup.rank, dup.size) == (backend.rank, backend.size)
    rank, size = backend.rank, backend.size
    errors: list[BaseException] = []

    def side() -> None:
        try:
            for i in range(15):
                buf = np.full(3, float(rank + i))
                dml.allreduce(dup, buf, dml.SUM)
                assert (buf == sum(r + i for r in range(size))).all(), (i, buf)
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    helper = threading.Thread(target=side, name="side-channel")
    helper.start()
    for i in range(15):
        buf = np.full(2, float(rank * 10 - i), dtype=np.float32)
        dml.allreduce(backend, buf, dml.MAX)
        assert (buf == (size - 1) * 10 - i).all(), (i, buf)
    helper.join(60)
    assert not helper.is_alive(), "the duplicate's thread hung"
    if errors:
        raise errors[0]
    _world_still_works(dup)
    _world_still_works(backend)


TENSOR_DTYPES = (*bodies.DTYPES, "complex64")
# Where a leaf's tensor comes from: its own storage, a view of an earlier leaf's (sharing it), a transposed
# (non-contiguous) view of its own, an nn.Parameter, a slice past its storage's start, or a big one (the storages
# of 1 MiB or more travel on their own, the others together); or a NumPy array: C- or Fortran-ordered (out of
# band), strided (in the pickle), read-only, or big.
NUMPY_FORMS = ("numpy", "numpy_fortran", "numpy_strided", "numpy_readonly", "numpy_big")
LEAF_FORMS = ("plain", "view", "transposed", "parameter", "offset", "big", *NUMPY_FORMS)


@st.composite
def tensor_cases(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, str, tuple[int, ...]]]]:
    """(root draw, seed, [(form, dtype, shape)]): a nested value of tensors to broadcast."""
    leaves = draw(
        st.lists(
            st.tuples(
                st.sampled_from(LEAF_FORMS),
                st.sampled_from(TENSOR_DTYPES),
                st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
            ),
            min_size=1,
            max_size=6,
        )
    )
    return draw(st.integers(0, 7)), draw(st.integers(0, 2**31 - 1)), leaves


def _tensor_value(seed: int, leaves: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, Any]:
    """The value ``tensor_cases`` describes, the same on every rank that builds it."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {"tensors": [], "meta": {"seed": seed, "n": len(leaves)}}
    # Protocol 5's buffers of other objects than NumPy's come back as pickle.loads gives them
    out["buffers"] = [pickle.PickleBuffer(bytearray(b"ab" * (seed % 7))), pickle.PickleBuffer(b"cd" * (seed % 9))]
    for form, dtype, drawn_shape in leaves:
        # big: at least 1 MiB in 4-byte dtypes, with a ragged tail
        big = form in ("big", "numpy_big", "numpy_readonly") and (form != "numpy_readonly" or len(drawn_shape) > 1)
        shape = ((1 << 18) + 3, *(max(1, d) for d in drawn_shape[:1])) if big else drawn_shape
        numel = int(np.prod(shape)) if shape else 1
        base = (torch.randn(numel + 2, generator=g) * 50).to(getattr(torch, dtype))
        t = base[2:].reshape(shape) if form == "offset" else base[:numel].reshape(shape)
        earlier = [e for e in out["tensors"] if isinstance(e, torch.Tensor) and e.numel()]
        if form == "view" and earlier:  # of the last leaf that has elements (a Parameter's too)
            t = earlier[-1].detach().reshape(-1)[: max(1, earlier[-1].numel() // 2)]
        elif form == "transposed" and t.dim() >= 2:
            t = t.transpose(0, -1)
        elif form == "parameter" and t.is_floating_point():
            t = torch.nn.Parameter(t.clone(), requires_grad=True)
        if form in NUMPY_FORMS:
            t = _numpy_leaf(form, t)
        out["tensors"].append(t)
    return out


def _numpy_leaf(form: str, t: torch.Tensor) -> np.ndarray:
    a = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()  # NumPy has no bfloat16
    if form == "numpy_fortran":
        a = np.asfortranarray(a.T if a.ndim >= 2 else a)
    elif form == "numpy_strided" and a.ndim:
        a = a[::2]
    elif form == "numpy_readonly":
        a.flags.writeable = False
    return a


def _check_numpy(got: Any, want: np.ndarray, where: Any) -> None:
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape, where
    # A strided array travels in the pickle, which copies it contiguous (as pickle.loads does): only its values
    # (and a stride along a dimension of size 1, or of an empty array, is arbitrary)
    strides = [(g, w) for g, w, n in zip(got.strides, want.strides, want.shape, strict=True) if n > 1]
    assert all(g == w for g, w in strides) or not want.flags.forc or not want.size, where
    assert got.flags.writeable == want.flags.writeable, where
    assert got.tobytes(order="A") == want.tobytes(order="A"), where


def _storage_ptr(t: torch.Tensor | np.ndarray) -> int | None:
    return None if isinstance(t, np.ndarray) else t.untyped_storage().data_ptr()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def tensors_apart(backend: dml.Backend) -> None:
    """Random nested tensors (dtypes, shapes, views sharing a storage, non-contiguous, Parameters, big ones) reach
    every rank exactly: bits, dtype, shape, strides and which tensors share a storage; in storages of their own."""
    drawn: list[tuple[int, int, list[tuple[str, str, tuple[int, ...]]]]] = []

    # The cases are drawn first, the same on every rank (derandomized); the collectives run after, outside hypothesis.
    @settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate], max_examples=12)
    @given(case=tensor_cases())
    @example(
        case=(
            1,
            7,
            [
                ("big", "float32", (2,)),
                ("view", "int8", ()),
                ("parameter", "float64", (2, 3)),
                ("view", "bool", (1,)),
                ("offset", "bfloat16", (4,)),
                ("transposed", "int16", (2, 3)),
                ("numpy_fortran", "float16", (3, 2)),
                ("numpy_readonly", "int64", (2, 2)),
                ("numpy_strided", "bfloat16", (5,)),
                ("numpy_big", "float32", ()),
            ],
        )
    )
    def draw(case: tuple[int, int, list[tuple[str, str, tuple[int, ...]]]]) -> None:
        drawn.append(case)

    draw()
    for root_draw, seed, leaves in drawn:
        root = root_draw % backend.size
        mine = _tensor_value(seed, leaves) if backend.rank == root else None
        got = dml.bcast_object(backend, mine, root=root)
        if backend.rank == root:
            assert got is mine
        else:
            _check_value(got, _tensor_value(seed, leaves), leaves)
        # and every rank's, each its own (the seed differs by rank)
        mine = _tensor_value(seed + backend.rank, leaves)
        every = dml.allgather_object(backend, mine)
        assert len(every) == backend.size and every[backend.rank] is mine
        for r, got in enumerate(every):
            if r != backend.rank:
                _check_value(got, _tensor_value(seed + r, leaves), leaves)
    _world_still_works(backend)


def _check_value(got: dict[str, Any], want: dict[str, Any], leaves: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """``got`` is ``want`` (a :func:`_tensor_value`) received: bits, dtype, shape, strides, which tensors share a
    storage; in memory of its own."""
    assert got["meta"] == want["meta"]
    assert [type(b) for b in got["buffers"]] == [bytearray, bytes], got["buffers"]
    assert got["buffers"] == [bytes(b) for b in want["buffers"]]
    assert len(got["tensors"]) == len(want["tensors"]), (got, leaves)
    ptrs = [_storage_ptr(w) for w in want["tensors"]]
    got_ptrs = [_storage_ptr(t) for t in got["tensors"]]
    for k, (t, w) in enumerate(zip(got["tensors"], want["tensors"], strict=True)):
        where = (k, leaves[k])
        if isinstance(w, np.ndarray):
            _check_numpy(t, w, where)
            continue
        assert type(t) is type(w) and t.dtype == w.dtype and t.shape == w.shape, where
        assert t.stride() == w.stride() and t.storage_offset() == w.storage_offset(), where
        assert t.requires_grad == w.requires_grad, where
        assert t.untyped_storage().nbytes() == w.untyped_storage().nbytes(), where
        assert torch.equal(t.detach(), w.detach()), where
        assert torch.equal(_storage_bytes(t), _storage_bytes(w)), where  # all of it, past the view too
        for j in range(k):  # a storage shared at the root is shared here, and only then
            assert (got_ptrs[j] == got_ptrs[k]) == (ptrs[j] == ptrs[k]) or not t.untyped_storage().nbytes(), where
    for k, a in enumerate(got["tensors"]):  # each array has memory of its own
        for b in got["tensors"][:k]:
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
                assert not np.shares_memory(a, b) or not a.nbytes, (k, leaves)


BODIES = [values, failures, large_pickle, duplicate, tensors_apart]
