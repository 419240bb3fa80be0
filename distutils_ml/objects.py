"""Object collectives: ``bcast_object`` and ``allgather_object`` (any picklable value, any size).

Objects travel as pickles, in pieces, so nothing limits their size (MPI counts are C
ints; a pickle over 2 GiB is sent in 1 GiB pieces). In a broadcast, the storages of CPU
tensors and the bytes of contiguous NumPy arrays travel apart from the pickle, as raw
buffers (sent in place from root, received into memory of their own): a 1 GiB checkpoint's
``dml.load`` on 2 ranks went from 11-13 s to 2.4-2.8 s (``torch.load`` alone: 0.8-1 s).
In ``allgather_object`` they travel in the same buffer as the pickle, after it (copied in
and out at memory speed, where pickling a storage costs about 6 s per GiB). Nothing fails
on one rank only:

- a value that cannot be pickled raises on every rank, naming the rank that held it;
- a value that some rank cannot unpickle (a class defined only in root's ``__main__``)
  raises on every rank too: after the transfer, the ranks agree on whether every one
  of them could read what it received.

:func:`run_on_root` lets root compute the value *inside* the collective (slow file
I/O, pickling), so the waiting ranks do not report root as missing, and raises root's
error on every rank.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import check_root

__all__ = ["allgather_object", "bcast_object", "digest", "run_on_root"]

T = TypeVar("T")
_OK, _FAILED = b"\x00", b"\x01"
_INLINE = b"\x02"  # as _OK, with the parts' bytes after the layout (see _inline)
# Where the class of a remote error is looked up, to raise the same class on every rank.
_ERROR_MODULES = {"builtins": builtins, "pickle": pickle, "_pickle": pickle}


@contextlib.contextmanager
def exclusive(backend: Backend, caller: str) -> Iterator[None]:
    """Hold ``backend`` for this thread during a call made of several collectives."""
    backend._enter(caller)
    try:
        yield
    finally:
        backend._leave()


def digest(text: str) -> int:
    """A signed 64-bit digest of ``text``, the same in every process (unlike ``hash``), to compare across ranks."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def error_status(exc: BaseException) -> tuple[str, str, str]:
    """What :func:`remote_error` rebuilds ``exc`` from on another rank: its class's module and name, its text."""
    return type(exc).__module__, type(exc).__qualname__, str(exc)


def remote_error(status: tuple[str, str, str], message: str) -> Exception:
    """An exception of the remote error's class where it is a builtin or pickle error, else RuntimeError."""
    module, name, text = status
    cls = getattr(_ERROR_MODULES.get(module), name, None)
    full = f"{message}: {name.rpartition('.')[2]}: {text}"
    try:
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(full)
    except Exception:  # a class that cannot be built from one message
        pass
    return RuntimeError(full)


def _agree(backend: Backend, problem: str | None, caller: str, failed: str | None = None) -> None:
    """Raise on every rank if any rank had a ``problem`` reading what it received (or, with ``failed``, the
    problem that says: "rank(s) [...] <failed> (...)").

    One allgather of a byte per rank; the problems' texts travel only when there is one.
    """
    flags = np.empty((backend.size, 1), dtype=np.int8)
    backend._allgather(np.array([problem is not None], dtype=np.int8), flags)
    if not flags.any():
        return
    problems = [pickle.loads(p) for p in backend._allgather_bytes(pickle.dumps(problem))]
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if bad:
        detail = "; ".join(f"rank {r}: {p}" for r, p in bad.items())
        if failed is not None:
            raise RuntimeError(f"{caller}: rank(s) {sorted(bad)} {failed} ({detail})")
        raise RuntimeError(
            f"{caller}: rank(s) {sorted(bad)} could not unpickle what they received ({detail}). Every rank must be "
            "able to import the classes of the object: define them in a module, not in one rank's __main__ only"
        )


class _StoragesApart(pickle.Pickler):
    """A pickler that leaves each CPU storage, and each contiguous NumPy array's bytes, out of the pickle,
    collecting them in ``parts`` instead.

    A tensor pickles as its storage plus a small description (offset, shape, strides); pickling
    the storage itself is slow (about 6 s per GiB: torch writes it into a byte buffer first) and
    so is unpickling it (3 s). The storages travel apart, as raw buffers, in place on root.
    Storages shared by several tensors (views, tied weights) travel once and stay shared.
    Contiguous NumPy arrays go out of band by pickle's protocol 5 (``buffer_callback``).
    """

    def __init__(self, file: io.BytesIO) -> None:
        parts: list[Any] = []  # UntypedStorages and, for NumPy's buffers, memoryviews, in pickling order

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:  # not a method: the pickler would hold itself
            raw = buffer.raw()
            if not isinstance(raw.obj, np.ndarray):  # bytes, bytearray, a user's class: in band, as pickle does
                return True
            parts.append(raw)
            return False

        super().__init__(file, protocol=5, buffer_callback=out_of_band)
        self.parts = parts
        self._index: dict[tuple[int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype  # .untyped() warns on every call
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        if untyped.device.type != "cpu":
            return None  # pickled as torch pickles it
        # A storage is named by its address and size: two storages over the same bytes (torch.from_numpy of one
        # array, twice) travel once and stay shared; over a part of them (of a slice of it), apart. An empty one
        # has no address, and travels alone.
        key = (untyped.data_ptr(), untyped.nbytes()) if untyped.nbytes() else None
        if key is None or key not in self._index:
            index = len(self.parts)
            self.parts.append(untyped)
            if key is not None:
                self._index[key] = index
            return (index, dtype)
        return (self._index[key], dtype)


class _StoragesBack(pickle.Unpickler):
    """Unpickles what :class:`_StoragesApart` pickled, with the parts received apart."""

    def __init__(self, data: memoryview, parts: list[Any]) -> None:
        buffers = [p for p in parts if isinstance(p, np.ndarray)]
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._parts = parts

    def persistent_load(self, pid: Any) -> Any:
        index, dtype = pid
        # A bare UntypedStorage (what torch pickles for dtypes without a typed storage class: uint16-64, float8,
        # complex32, rebuilt by _rebuild_tensor_v3, which reads its ._untyped_storage) comes back wrapped as bytes.
        return torch.storage.TypedStorage(wrap_storage=self._parts[index], dtype=dtype or torch.uint8, _internal=True)


_TRAILER = struct.Struct("<q")  # at the end: the length of the parts' layout, pickled, before it
_SMALL_PART = 1 << 20  # parts below this travel together in one buffer, the others one by one in place


def _nbytes(part: Any) -> int:
    return part.nbytes if isinstance(part, memoryview) else part.nbytes()


def _layout(parts: list[Any]) -> list[tuple[bool, int]]:
    """Per part: (a NumPy buffer?, its size)."""
    return [(isinstance(p, memoryview), _nbytes(p)) for p in parts]


def _pack_apart(produce: Callable[[], Any]) -> tuple[bytes | memoryview, BaseException | None, list[Any]]:
    """``produce()`` pickled with its CPU storages and NumPy buffers left out: ``_OK``, the value's pickle,
    the parts' layout (pickled), the length of that; and the parts. Nothing is copied after pickling.
    A failure becomes ``_FAILED`` and a pickled description instead, and no parts."""
    try:
        value = produce()
        out = io.BytesIO()
        out.write(_OK)
        pickler = _StoragesApart(out)
        pickler.dump(value)
        layout = pickle.dumps(_layout(pickler.parts))
        out.write(layout)
        out.write(_TRAILER.pack(len(layout)))
        return out.getbuffer(), None, pickler.parts
    except Exception as exc:
        return _FAILED + pickle.dumps(error_status(exc)), exc, []


def _bytes_of(part: Any) -> np.ndarray:
    """A part's bytes as a uint8 array (no copy)."""
    if isinstance(part, np.ndarray):
        return part
    if isinstance(part, memoryview):
        return np.frombuffer(part, dtype=np.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(part, 0, (part.nbytes(),), (1,)).numpy()


def _copy_parts(parts: list[Any], flat: np.ndarray, *, into_flat: bool) -> None:
    """Copy ``parts``' bytes, one after another, into ``flat`` (``into_flat=False``: from it, into the parts)."""
    at = 0
    for p in parts:
        mine = _bytes_of(p)
        if into_flat:
            flat[at : at + mine.size] = mine
        else:
            mine[:] = flat[at : at + mine.size]
        at += mine.size


def _send_parts(backend: Backend, root: int, parts: list[Any], layout: list[tuple[bool, int]]) -> None:
    """Root's parts into every rank's (same sizes, in order): those under 1 MiB in one buffer, each other alone,
    in place."""
    is_root = backend.rank == root
    alone = [n >= _SMALL_PART for _, n in layout]
    together = [p for p, big in zip(parts, alone, strict=True) if not big]
    total = sum(n for (_, n), big in zip(layout, alone, strict=True) if not big)
    if total:
        flat = np.empty(total, dtype=np.uint8)
        if is_root:
            _copy_parts(together, flat, into_flat=True)
        backend._bcast(flat, root)
        if not is_root:
            _copy_parts(together, flat, into_flat=False)
    for p, big in zip(parts, alone, strict=True):
        if big:
            backend._bcast(_bytes_of(p), root)


def _split(view: memoryview) -> tuple[memoryview, list[tuple[bool, int]]]:
    """What :func:`_pack_apart` made (``_OK`` first): the value's pickle and the parts' layout."""
    (length,) = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
    end = len(view) - _TRAILER.size - length  # where the value's pickle ends and its parts' layout begins
    return view[1:end], pickle.loads(view[end : end + length])


def _room(layout: list[tuple[bool, int]]) -> list[Any]:
    """Fresh memory for the parts ``layout`` describes: a uint8 array for a NumPy buffer, else a storage.

    The arrays' memory comes from torch's allocator (the library loads torch): a 256 MiB array received into it
    took 0.12 s on 2 ranks, and 0.43 s into ``np.empty``'s (benchmarks/objects.py)."""
    return [_bytes_of(torch.UntypedStorage(n)) if numpy else torch.UntypedStorage(n) for numpy, n in layout]


def _inline(data: bytes | memoryview, parts: list[Any]) -> bytearray:
    """What :func:`_pack_apart` made (``_OK`` first), with ``_INLINE`` first instead, then the parts' bytes, then
    their length: one buffer (the parts copied once, at memory speed, where pickling a tensor's storage costs
    about 6 s per GiB)."""
    out = bytearray(len(data) + sum(_nbytes(p) for p in parts) + _TRAILER.size)
    flat = np.frombuffer(out, dtype=np.uint8)
    flat[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    flat[0] = _INLINE[0]
    _copy_parts(parts, flat[len(data) : len(out) - _TRAILER.size], into_flat=True)
    _TRAILER.pack_into(out, len(out) - _TRAILER.size, len(out) - _TRAILER.size - len(data))
    return out


def _pack_together(produce: Callable[[], Any]) -> tuple[bytes | bytearray, BaseException | None]:
    """``produce()`` as one buffer: :func:`_inline`, or ``_FAILED`` and a pickled description."""
    data, cause, parts = _pack_apart(produce)
    return (bytes(data), cause) if cause is not None else (_inline(data, parts), None)


def _unpack_inline(data: bytes | bytearray) -> Any:
    """The value in :func:`_inline`'s bytes, its parts in memory of their own."""
    view = memoryview(data)
    (length,) = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
    blob_at = len(view) - _TRAILER.size - length
    pickled, layout = _split(view[:blob_at])
    parts = _room(layout)
    _copy_parts(parts, np.frombuffer(view[blob_at : len(view) - _TRAILER.size], dtype=np.uint8), into_flat=False)
    return _StoragesBack(pickled, parts).load()


def _unpack_together(data: bytes | bytearray) -> tuple[bool, Any]:
    """(True, value) or (False, the producer's error description) from :func:`_pack_together`'s bytes."""
    if data[:1] == _FAILED:
        return False, pickle.loads(memoryview(data)[1:])
    return True, _unpack_inline(data)


def _broadcast(backend: Backend, root: int, produce: Callable[[], Any], caller: str, failed: str) -> Any:
    """``produce()`` run on root inside one object broadcast; its value (or, prefixed by ``failed``, its error).

    Its CPU tensors' storages and contiguous NumPy arrays travel apart from the pickle, as raw buffers
    (:class:`_StoragesApart`): one broadcast of the pickle and the parts' sizes, then, once every rank
    has made room for them, the parts themselves. Parts of less than 1 MiB in all travel after the
    pickle, in its broadcast (:func:`_inline`).
    """
    if backend.debug:
        backend._check_call("bcast_object", None, None, None, root)
    is_root = backend.rank == root
    cause: list[BaseException | None] = [None]
    value: list[Any] = [None]
    kept: list[Any] = []

    def make() -> bytes | memoryview:
        def keep() -> Any:
            value[0] = produce()
            return value[0]

        data, cause[0], parts = _pack_apart(keep)
        if parts and sum(_nbytes(p) for p in parts) < _SMALL_PART:  # in the same broadcast: no collective more
            return _inline(data, parts)
        kept.extend(parts)
        return data

    data = backend._bcast_bytes(None, root, make if is_root else None)
    view = memoryview(data)
    if data[:1] == _FAILED:  # root's error, as a pickled description: no parts follow
        problem = None
        received = None
        try:
            received = pickle.loads(view[1:])
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        _agree(backend, problem, caller)
        raise remote_error(received, failed) from cause[0]
    problem = None
    if data[:1] == _INLINE:

        def load() -> Any:
            return _unpack_inline(data)

    else:
        pickled, layout = _split(view)
        parts = kept
        if layout and not is_root:
            try:
                parts = _room(layout)
            except Exception as exc:  # MemoryError: too little room for root's tensors
                total = sum(n for _, n in layout)
                problem = f"{type(exc).__name__} making room for {total} bytes of tensors and arrays: {exc}"
        if layout:
            _agree(backend, problem, caller, "could not make room for the tensors and arrays")
            _send_parts(backend, root, parts, layout)

        def load() -> Any:
            return _StoragesBack(pickled, parts).load()

    received = value[0]
    if not is_root and problem is None:
        try:
            received = load()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    _agree(backend, problem, caller)
    return received


def bcast_object(backend: Backend, obj: Any, *, root: int = 0) -> Any:
    """Return root's ``obj`` on every rank: any picklable value, of any size.

    Root gets its own ``obj`` back (not a copy); the other ranks get an unpickled copy.
    Only root's ``obj`` is read.

    Args:
        backend: from ``dml.get_distributed_backend``.
        obj: a picklable value (metrics, a config, RNG states...).
        root: the rank whose value every rank gets.

    Raises:
        TypeError, AttributeError, pickle.PicklingError: root's value cannot be pickled (the
            pickling error's class, raised on every rank).
        RuntimeError: some rank could not unpickle it (raised on every rank, naming them).

    Example:
        >>> dml.bcast_object(backend, {"lr": 0.1, "epochs": 3}, root=0)
        {'lr': 0.1, 'epochs': 3}
    """
    check_backend(backend, "bcast_object")
    root = check_root(backend, root)
    with exclusive(backend, "bcast_object"):
        root = backend.acting_root(root)
        failed = f"bcast_object: the object of rank {root} cannot be pickled"
        return _broadcast(backend, root, lambda: obj, "bcast_object", failed)


def run_on_root(backend: Backend, fn: Callable[[], T], *, root: int = 0, what: str = "run_on_root") -> T:
    """Run ``fn()`` on root inside one object broadcast; return its value on every rank.

    While root runs ``fn`` (slow file I/O, pickling), every rank counts as inside this
    collective, so stall detection does not take root for missing. If ``fn`` raises on
    root, every rank raises: the same class for builtin and pickle errors, else
    ``RuntimeError``, with the message ``f"{what}: rank {root}: {Class}: {text}"``
    (chained from the original exception on root).
    """
    check_backend(backend, what)
    root = check_root(backend, root)
    with exclusive(backend, what):
        root = backend.acting_root(root)
        return _broadcast(backend, root, fn, what, f"{what}: rank {root}")


def allgather_object(backend: Backend, obj: Any) -> list[Any]:
    """Return every rank's ``obj``, in rank order, on every rank: any picklable values, of any size.

    Args:
        backend: from ``dml.get_distributed_backend``.
        obj: this rank's picklable value.

    Returns:
        ``[obj of rank 0, obj of rank 1, ...]``; this rank's entry is its own ``obj``.

    Raises:
        TypeError, AttributeError, pickle.PicklingError: some rank's value cannot be pickled
            (the pickling error's class, raised on every rank, naming that rank).
        RuntimeError: some rank could not unpickle another's value (raised on every rank).

    Example:
        >>> dml.allgather_object(backend, {"rank": dml.local_rank(backend), "loss": 0.5})
        [{'rank': 0, 'loss': 0.5}]
    """
    check_backend(backend, "allgather_object")
    with exclusive(backend, "allgather_object"):
        if backend.debug:
            backend._check_call("allgather_object", None, None, None, -1)
        mine, cause = _pack_together(lambda: obj)
        parts = backend._allgather_bytes(mine)
        values: list[Any] = []
        problem = None
        for r, data in enumerate(parts):
            if r == backend.rank:
                values.append((cause is None, obj if cause is None else pickle.loads(memoryview(data)[1:])))
                continue
            try:
                values.append(_unpack_together(data))
            except Exception as exc:
                problem = problem or f"{type(exc).__name__} reading rank {r}'s object: {exc}"
                values.append((True, None))
        _agree(backend, problem, "allgather_object")
        for r, (ok, value) in enumerate(values):
            if not ok:
                raise remote_error(value, f"allgather_object: the object of rank {r} cannot be pickled") from (
                    cause if r == backend.rank else None
                )
        return [value for _, value in values]
