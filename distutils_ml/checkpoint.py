"""Checkpoints: ``save`` on rank 0, atomically; ``load`` on rank 0, checked and broadcast.

``save`` turns live objects into their state (a module, optimizer, LR scheduler or
stateful data loader into its ``state_dict()``, a ``DistributedDataContainer`` into
``{"epoch": ...}``), so ``dml.save(backend, {"model": model, "opt": opt}, path)`` writes
what ``torch.load(path, weights_only=True)`` can read back (``dml.load`` admits NumPy arrays
and scalars besides, which ``torch.load`` asks to be allowed first). Rank 0 writes a temporary
file beside ``path`` (past the page cache, ``O_DIRECT``, where the file system allows:
:class:`_DirectFile`), fsyncs it, then renames it over ``path``: a crash
leaves either the old checkpoint or the new one, never half of one. A write that fails
removes its temporary file; one cut short by a signal (the job aborted, killed) leaves
it behind, and the next successful ``save`` to the same path removes it. The writer
holds an ``flock`` on its temporary file until the rename, so saves to one path from
several jobs at once never remove each other's: only files whose writer is gone.
``load`` checks every record against the CRC-32 that ``torch.save`` wrote before
reading it (``torch.load`` does not), so a corrupted file is an error, not wrong values.
Rank 0 reads and writes inside a collective (``run_on_root``): slow I/O is not a stall.
Every rank learns the outcome from rank 0, so an error is raised on every rank and no
rank is left waiting in the next collective.

The random number generator states a checkpoint holds are :mod:`distutils_ml.rng`'s; its
functions stay importable from here too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import io
import mmap
import os
import pickle
import re
import secrets
import stat
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.data import DistributedDataContainer
from distutils_ml.objects import allgather_object, run_on_root
from distutils_ml.rng import rng_state, rng_state_all, set_rng_state, set_rng_state_all

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DESCEND",
    "check_path",
    "check_resumable",
    "consolidated_states",
    "load",
    "rebuilds",
    "rebuilt",
    "rng_state",
    "rng_state_all",
    "save",
    "set_rng_state",
    "set_rng_state_all",
    "state_of",
    "write_atomic",
]

# Where file systems without flock (some Lustre mounts, Windows) leave a temporary file
# alone: one modified this recently may still have a live writer.
_UNLOCKED_STALE_AFTER_S = 600.0
# errno values of flock on a file system that does not support it.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_CHUNK = 1 << 24  # bytes read at a time while checking a checkpoint's CRC-32s
_DOS_DIRECTORY = 0x10  # the "directory" bit of a zip record's external attributes
# Direct writes (O_DIRECT): whole blocks of this many bytes from one page-aligned buffer, at offsets that are
# multiples of it; the last bytes (less than a block of _DIRECT_ALIGN) through the page cache.
_DIRECT_BLOCK = 8 << 20
_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# errno of a direct write that the file system refuses (alignment, or no O_DIRECT at all).
_DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


class _DirectFile:
    """The write-only file ``torch.save`` writes a checkpoint into: past the page cache where the file system
    allows it (O_DIRECT), through it where it does not.

    A checkpoint goes to disk once and is read back only after a failure, so caching it buys nothing, and
    copying it into the page cache, then writing the dirty pages back, costs the CPU that training uses: 184
    MiB took 0.04-0.44 s of CPU through the page cache and 0.01 s direct on this machine's disk, and 0.3 s of
    the writer thread's CPU while two ranks trained. Data is gathered into one page-aligned block buffer and
    written a whole block at a time; the tail of the file (under one aligned unit) and everything after a
    direct write is refused (``EINVAL``: a file system without O_DIRECT, or with other alignment rules) go
    through the page cache. The caller fsyncs and closes ``fd``.
    """

    def __init__(self, fd: int, *, direct: bool = True) -> None:
        self._fd = fd
        self._direct = False
        if direct and _O_DIRECT and fcntl is not None:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
                self._direct = True
            except OSError:  # not on this file system: through the page cache
                pass
        self._block = mmap.mmap(-1, _DIRECT_BLOCK) if self._direct else None
        self._filled = 0
        #: the first write that failed (torch's writer turns it into an error of its own: "unexpected pos")
        self.failure: OSError | None = None

    def write(self, data: Any) -> int:
        """Write all of ``data`` (any bytes-like object); return its length."""
        try:
            return self._write(data)
        except OSError as e:
            self.failure = self.failure or e
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self._block is None:
            _write_all(self._fd, view)
            return n
        done = 0
        while done < n:
            k = min(n - done, _DIRECT_BLOCK - self._filled)
            self._block[self._filled : self._filled + k] = view[done : done + k]
            self._filled += k
            done += k
            if self._filled == _DIRECT_BLOCK:
                self._write_block(_DIRECT_BLOCK)
        return n

    def flush(self) -> None:
        """Nothing to do before :meth:`finish` (``torch.save`` calls it)."""

    def close(self) -> None:
        """Free the block buffer (after :meth:`finish`, or instead of it when the write failed)."""
        if self._block is not None:
            block, self._block, self._filled = self._block, None, 0
            # A failed write's traceback may still hold a view of it (BufferError, which would hide that failure):
            # then it is freed with the traceback.
            with contextlib.suppress(BufferError):
                block.close()

    def finish(self) -> None:
        """Write what the block buffer holds: its aligned part direct, the rest through the page cache."""
        if self._block is None:
            return
        aligned = self._filled - self._filled % _DIRECT_ALIGN
        if aligned:
            self._write_block(aligned)
        self._buffered()
        view = memoryview(self._block)
        try:
            _write_all(self._fd, view[: self._filled])
        finally:
            view.release()
        self.close()

    def _write_block(self, nbytes: int) -> None:
        """Write the buffer's first ``nbytes`` direct (through the page cache from where that is refused); keep
        the rest at the buffer's start."""
        assert self._block is not None
        view = memoryview(self._block)
        try:
            done = 0
            while done < nbytes:
                try:
                    done += _write_some(self._fd, view[done:nbytes])
                except OSError as e:
                    if not self._direct or e.errno not in _DIRECT_REFUSED:
                        raise
                    self._buffered()  # a refused write writes nothing: the same bytes again, buffered
            left = self._filled - nbytes
            view[:left] = view[nbytes : self._filled]
            self._filled = left
        finally:
            view.release()

    def _buffered(self) -> None:
        """From now on through the page cache."""
        if self._direct:
            assert fcntl is not None
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self._direct = False


def _write_all(fd: int, view: memoryview) -> None:
    """``os.write`` until every byte of ``view`` is written."""
    while len(view):
        view = view[_write_some(fd, view) :]


def _write_some(fd: int, view: memoryview) -> int:
    """One ``os.write``: how many bytes it wrote (none is an error, not a reason to try forever)."""
    n = _os_write(fd, view)
    if n <= 0:
        raise OSError(errno.EIO, f"write of {len(view)} bytes wrote nothing")
    return n


_os_write = os.write  # the one system call the writer makes (tests put failures in its place)


def check_path(path: Any, caller: str) -> str:
    """``path`` as a str, or a ``TypeError`` / ``ValueError`` naming what was given."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{caller}: path: got {type(path).__qualname__}; allowed: a str or os.PathLike file path")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{caller}: path: got the bytes path {text!r}; allowed: a str or os.PathLike of str")
    if not text:
        raise ValueError(f"{caller}: path: got an empty string; allowed: a file path")
    return text


DESCEND = object()  # a leaf function's answer: not a leaf, rebuild the container around its items


def rebuilds(obj: Any) -> bool:
    """Whether :func:`rebuilt` rebuilds ``obj`` around its items: a dict, list or tuple, a namedtuple or a
    dataclass instance (anything else is a leaf to it)."""
    return (
        type(obj) in (dict, OrderedDict, list, tuple)
        or (isinstance(obj, tuple) and hasattr(type(obj), "_fields"))
        or (dataclasses.is_dataclass(obj) and not isinstance(obj, type))
    )


def rebuilt(obj: Any, leaf: Callable[[Any, str], Any], where: str = "obj") -> Any:
    """``obj`` with ``leaf(x, where)`` in place of each item ``x`` for which it does not return ``DESCEND``.

    dicts, lists, tuples, namedtuples and dataclasses are rebuilt with the same types (frozen
    dataclasses too); anything else is kept as it is. ``where`` names the item (``obj['opt']``).
    """
    out = leaf(obj, where)
    if out is not DESCEND:
        return out
    if type(obj) in (dict, OrderedDict):
        new = type(obj)((k, rebuilt(v, leaf, f"{where}[{k!r}]")) for k, v in obj.items())
        if getattr(obj, "__dict__", None):  # a state_dict()'s _metadata (the modules' versions): kept
            new.__dict__.update(obj.__dict__)
        return new
    if type(obj) in (list, tuple):
        return type(obj)(rebuilt(v, leaf, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # namedtuple
        return type(obj)(*(rebuilt(getattr(obj, f), leaf, f"{where}.{f}") for f in type(obj)._fields))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, rebuilt(getattr(obj, f.name), leaf, f"{where}.{f.name}"))
        return new
    return obj


def _state_leaf(obj: Any, where: str) -> Any:
    if isinstance(obj, (torch.Tensor, np.ndarray, type)):
        return obj
    if callable(getattr(obj, "state_dict", None)):  # modules, optimizers, schedulers, StatefulDataLoader
        return obj.state_dict()
    if isinstance(obj, DistributedDataContainer):
        return {"epoch": obj.epoch}
    if isinstance(obj, torch.utils.data.DataLoader):
        raise TypeError(
            f"save: a torch.utils.data.DataLoader has no state to save ({where}; resumed, it starts its "
            "epoch from the beginning); save the DistributedDataContainer instead (its epoch), and for a "
            "mid-epoch resume use torchdata's StatefulDataLoader, which saves its position"
        )
    return DESCEND


def state_of(obj: Any) -> Any:
    """``obj`` with live objects replaced by their state, containers rebuilt recursively (same types)."""
    return rebuilt(obj, _state_leaf)


def _sharded_at(obj: Any) -> list[str]:
    """Where ``obj`` holds sharded optimizers (``obj['opt']``...), in the order ``consolidated_states`` asks them."""
    from distutils_ml.sharded import ShardedOptimizer

    found: list[str] = []

    def leaf(x: Any, where: str) -> Any:
        if isinstance(x, ShardedOptimizer):
            found.append(where)
            return x
        return x if isinstance(x, (torch.Tensor, np.ndarray, type)) else DESCEND

    rebuilt(obj, leaf)
    return found


def consolidated_states(backend: Backend, obj: Any) -> Any:
    """``obj`` with every sharded optimizer replaced by its ``state_dict(to=0)``, on every rank (collectives).

    A ``dml.ShardedOptimizer`` consolidates its state from every rank's shard, so every rank must
    ask for it, in the same order. The ranks first compare where their ``obj`` holds sharded
    optimizers (one small allgather) and all raise the same ``ValueError`` where they differ:
    otherwise some would wait for the others' shards forever. Only rank 0, the writer, receives
    the full state (on the CPU); the other ranks get None.
    """
    places = allgather_object(backend, _sharded_at(obj))
    if any(p != places[0] for p in places):
        differ = [r for r, p in enumerate(places) if p != places[0]]
        raise ValueError(
            f"save: obj holds sharded optimizers at {', '.join(places[0]) or 'no place'} on rank 0 but at "
            f"{', '.join(places[differ[0]]) or 'no place'} on rank {differ[0]} ({len(differ)} rank(s) differ). A "
            "DistributedOptimizer(shard_state=True) is saved from every rank's shard of its state, so every rank "
            "must pass it in the same place: pass the same structure on every rank (only rank 0's other objects "
            "are written)"
        )
    if not places[0]:
        return obj
    from distutils_ml.sharded import ShardedOptimizer

    def leaf(x: Any, where: str) -> Any:
        if isinstance(x, ShardedOptimizer):
            return x.state_dict(to=0)
        return x if isinstance(x, (torch.Tensor, np.ndarray, type)) else DESCEND

    return rebuilt(obj, leaf)


def _leftover_temporaries(path: str) -> list[str]:
    """Temporary files of saves to ``path``: live writers' and those of saves cut short (a killed job)."""
    directory, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}\.tmp")
    return [os.path.join(directory, n) for n in os.listdir(directory) if pattern.fullmatch(n)]


def _flock(fd: int, blocking: bool) -> bool | None:
    """Take an exclusive ``flock`` on ``fd``: True; held by someone else (non-blocking): False; no locks here: None."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return True


def _is_named(fd: int, name: str) -> bool:
    """Whether ``name`` is still a name of the file open as ``fd``."""
    try:
        st = os.stat(name)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def _remove_abandoned_temporaries(path: str) -> None:
    """Remove the temporary files of saves to ``path`` whose writer is gone.

    A writer holds an exclusive ``flock`` on its temporary file from creation until it is
    renamed, and the lock dies with the writer's process: a file whose lock can be taken
    has no live writer. Without ``flock`` (file systems that lack it), a file is taken
    for abandoned once nothing modified it for ``_UNLOCKED_STALE_AFTER_S`` seconds.
    """
    for candidate in _leftover_temporaries(path):
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except OSError:  # renamed or removed meanwhile, or not ours to read
            continue
        try:
            locked = _flock(fd, blocking=False)
            if locked is False:
                continue  # its writer is alive
            if locked is None and time.time() - os.fstat(fd).st_mtime < _UNLOCKED_STALE_AFTER_S:
                continue
            if _is_named(fd, candidate):
                with contextlib.suppress(OSError):
                    os.unlink(candidate)
        finally:
            os.close(fd)


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    """A new temporary file beside the checkpoint, locked (``flock``) for as long as its descriptor is open."""
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        # os.open, not tempfile: the checkpoint gets the usual permissions (0o666 less the umask).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _flock(fd, blocking=True)
            # Between os.open and flock, another save may have taken the new, unlocked file
            # for abandoned and removed it: then start again with a new name.
            if _is_named(fd, tmp):
                return fd, tmp
        except BaseException:
            if _is_named(fd, tmp):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            os.close(fd)
            raise
        os.close(fd)


def _check_directory(directory: str, path: str) -> None:
    """Raise a clear error when ``directory`` (that of ``path``) is missing, not a directory, or out of reach."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"the directory {directory!r} of {path!r} does not exist; create it first") from None
    except NotADirectoryError:
        raise NotADirectoryError(
            f"the directory {directory!r} of {path!r} is not a directory (part of its path is a file); "
            "save to a path inside a directory"
        ) from None
    except PermissionError:
        raise PermissionError(
            f"permission denied: this process (uid {os.geteuid()}) may not search a directory on the way to "
            f"{directory!r} (the directory of {path!r}); allow it (chmod +x) or save elsewhere"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(
            f"the directory {directory!r} of {path!r} is not a directory (it is a file); save to a path inside a "
            "directory"
        )


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    """Make ``torch.save`` write CRC-32s (``load`` checks them), even if the user turned them off."""
    get = getattr(torch.serialization, "get_crc32_options", None)  # torch < 2.6 always writes them
    if get is None or get():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


def write_atomic(state: Any, path: str) -> None:
    """``torch.save(state)`` to a locked temporary file beside ``path``, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    _check_directory(directory, path)
    try:
        fd, tmp = _create_temporary(directory, os.path.basename(path))
    except PermissionError:
        missing = " and ".join(w for w, m in (("write", os.W_OK), ("search", os.X_OK)) if not os.access(directory, m))
        raise PermissionError(
            f"permission denied: this process (uid {os.geteuid()}) may not {missing or 'create files in'} the "
            f"directory {directory!r} (of {path!r}); allow it or save elsewhere"
        ) from None
    try:
        # The descriptor stays open, so the lock held, until the file has its final name:
        # a concurrent save to the same path never takes it for abandoned.
        f = _DirectFile(fd)
        try:
            try:
                with _crc32_on():
                    torch.save(state, f)
            except Exception as e:
                if f.failure is not None and e is not f.failure:  # the disk's own error (ENOSPC, EFBIG), not torch's
                    raise f.failure from e
                raise
            f.finish()
            os.fsync(fd)
            os.replace(tmp, path)
        finally:
            try:
                f.close()
            finally:
                os.close(fd)  # whatever closing the buffer does: no descriptor (and no disk space) left behind
    except BaseException:  # any failure, KeyboardInterrupt included: leave no partial file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _remove_abandoned_temporaries(path)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _check_records(f: IO[bytes]) -> None:
    """Read every record of the zip open as ``f`` through ``zipfile``, which checks each one's CRC-32."""
    if not zipfile.is_zipfile(f):
        f.seek(0)
        head = f.read(4)
        f.seek(0)
        if head in (b"PK\x03\x04"[: len(head)], b"") and (head or os.fstat(f.fileno()).st_size == 0):
            # torch's zip format, with no readable end (a file cut short, or empty): is_zipfile finds no directory
            raise zipfile.BadZipFile("the zip's end of central directory is missing: the file was cut short")
        return  # the legacy format, or not a checkpoint at all: torch.load says which
    with zipfile.ZipFile(f) as archive:
        records = archive.infolist()
        if all(r.CRC == 0 for r in records if r.file_size):
            return
        for record in records:
            # torch's zip reader (miniz) reads a record marked as a directory as empty and leaves the
            # tensor's memory uninitialised: a flipped attribute bit would load as garbage.
            if record.is_dir() or record.external_attr & _DOS_DIRECTORY:
                raise zipfile.BadZipFile(f"the record {record.filename!r} is marked as a directory")
            with archive.open(record) as data:
                while data.read(_CHUNK):
                    pass


def _verify(f: IO[bytes]) -> None:
    """Check every record of the zip checkpoint open as ``f`` against its CRC-32; leave ``f`` at its start.

    ``torch.load`` does not check them, so without this a flipped byte in a tensor loads
    as a wrong value. Files without checksums pass unchecked: torch's legacy (non-zip)
    format, and zips written with ``torch.serialization.set_crc32_options(False)``
    (every CRC-32 is then 0).
    """
    try:
        _check_records(f)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # an I/O error, not a garbled file
            raise
        problem: Exception = exc  # a garbled offset: a seek before the start of the file
    except Exception as exc:  # BadZipFile, EOFError, a garbled header (ValueError, NotImplementedError, ...)
        problem = exc
    else:
        return
    finally:
        f.seek(0)
    raise RuntimeError(
        f"the file is corrupted ({type(problem).__name__}: {problem}): its bytes are not those that were saved. "
        "Restore it from a copy or an older checkpoint"
    )


def _numpy_globals() -> list[Any]:
    """What NumPy arrays, scalars and dtypes unpickle with: the globals ``load`` admits under ``weights_only``
    beside torch's own (their contents, object arrays' items included, are unpickled under the same rules)."""
    try:
        from numpy._core import multiarray  # NumPy 2
    except ImportError:  # pragma: no cover - NumPy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    allowed: list[Any] = [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype]
    # The names NumPy 1 pickles them by (numpy.core), for checkpoints written there and read under NumPy 2.
    allowed += [(multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
                (multiarray.scalar, "numpy.core.multiarray.scalar")]  # fmt: skip
    kinds = getattr(np, "dtypes", None)  # the dtypes' classes (NumPy >= 1.25), which some pickles name
    if kinds is not None:
        allowed += [k for n in dir(kinds) if n.endswith("DType") and isinstance(k := getattr(kinds, n), type)]
    return allowed


def _torch_load(f: IO[bytes], weights_only: bool) -> Any:
    if not weights_only:
        return torch.load(f, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location="cpu", weights_only=True)


def _read_verified(path: str, weights_only: bool) -> Any:
    """``torch.load`` of ``path`` after checking its CRC-32s, both through one open file (safe from a rename)."""
    with open(path, "rb") as f:
        _verify(f)
        return _torch_load(f, weights_only)


def _refused(obj: Any) -> str | None:
    """Why ``load`` (``weights_only=True``) would not read ``obj`` back, or None."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        _torch_load(buffer, True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        return lines[0] if lines else str(e).splitlines()[0]
    return None


def _children(obj: Any, where: str) -> list[tuple[Any, str]]:
    if type(obj) in (dict, OrderedDict):
        return [(v, f"{where}[{k!r}]") for k, v in obj.items()] + [(k, f"a key of {where}") for k in obj]
    if type(obj) in (list, tuple, set, frozenset):
        return [(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    return []


def check_resumable(obj: Any, caller: str, where: str = "state") -> None:
    """Raise a ``ValueError`` naming the first value in ``obj`` that ``load`` (``weights_only=True``, NumPy values
    admitted) would refuse to read back: a checkpoint that cannot be resumed is refused when it is written.

    Plain tensors are left out of the check (they always load), so it costs a pickle of the rest.
    """

    def blank(x: Any, _: str) -> Any:
        return None if type(x) in (torch.Tensor, torch.nn.Parameter) else DESCEND

    skeleton = rebuilt(obj, blank)
    problem = _refused(skeleton)
    if problem is None:
        return
    culprit = where
    while True:  # down to the innermost value that is refused by itself
        for child, place in _children(skeleton, culprit):
            reason = _refused(child)
            if reason is not None:
                skeleton, culprit, problem = child, place, reason
                break
        else:
            break
    raise ValueError(
        f"{caller}: {culprit} ({type(skeleton).__qualname__}) could not be read back when resuming: checkpoints are "
        f"loaded with torch.load(weights_only=True), which refuses it ({problem}). Store plain values there (numbers, "
        "strings, tensors, NumPy arrays, lists and dicts of them), or allow its class with "
        "torch.serialization.add_safe_globals on every run that saves or resumes"
    )


def save(backend: Backend, obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` on rank 0, atomically; every rank returns once it is written.

    Live objects anywhere inside dicts, lists, tuples, namedtuples and dataclasses
    (rebuilt with the same types; ``load`` reads the last two back only with
    ``weights_only=False`` or ``torch.serialization.add_safe_globals``) are saved as
    their state: a ``torch.nn.Module``, a
    ``torch.optim.Optimizer`` (``dml.DistributedOptimizer`` included: the wrapped
    optimizer's), and anything else with a ``state_dict()`` method (LR schedulers,
    torchdata's ``StatefulDataLoader``: its position in the epoch) as its
    ``state_dict()``; a ``dml.DistributedDataContainer`` as ``{"epoch": container.epoch}``.
    Restore them with ``load_state_dict`` and ``set_epoch``. A plain
    ``torch.utils.data.DataLoader`` holds no position and is refused (``TypeError``):
    with it, a resumed run starts the saved epoch from its first batch. Only rank 0's
    ``obj`` is read; the other ranks' ``obj`` is ignored, except that a sharded optimizer
    (``shard_state=True``) must stand at the same place in every rank's ``obj``: its state is
    consolidated from every rank's shard (a ``ValueError`` on every rank otherwise).

    A checkpoint to resume from holds every rank's random number generator states: save
    ``dml.rng_state_all(backend)``, not ``dml.rng_state()`` (rank 0's alone, since only rank
    0's ``obj`` is written), and restore it with ``dml.set_rng_state_all``. What else to save
    and in which order to restore it is the exact-resume recipe (docs/reliability.md, "Exact
    resume").

    The file is written by ``torch.save`` (with CRC-32s, which ``load`` checks) to a
    temporary file in the same directory, flushed, fsynced and renamed over ``path``, so
    ``path`` holds either the previous checkpoint or the complete new one, never a
    partial file. The temporary file is removed when the write fails; temporary files
    that earlier saves to ``path`` left behind when their job was killed are removed
    once this save succeeds. Saves to one path from several jobs at the same time all
    succeed (the last rename wins): a temporary file is removed only when its writer's
    ``flock`` is free, that is when the writer is gone.

    Args:
        backend: from ``dml.get_distributed_backend``.
        obj: what to save (the same structure on every rank, though only rank 0's counts).
        path: the checkpoint file; its directory must exist.

    Raises:
        TypeError: ``backend`` is not a backend instance, or ``path`` is not a str or
            os.PathLike (raised before any communication).
        ValueError: ``path`` is empty.
        Exception: if rank 0 fails to write (an unpicklable object, a plain DataLoader,
            a full disk, a directory that is missing (``FileNotFoundError``), not a
            directory (``NotADirectoryError``) or out of reach (``PermissionError``)),
            every rank raises the same class of error (a builtin or pickle error, else
            ``RuntimeError``) with the message ``"save: could not write the checkpoint
            '<path>': rank 0: <class>: <rank 0's message>"``; an existing checkpoint at
            ``path`` is left as it was.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> state = {"model": model, "opt": opt, "sched": sched, "step": 10}
        >>> dml.save(backend, {**state, "rng": dml.rng_state_all(backend)}, "ckpt.pt")  # every rank's streams
    """
    check_backend(backend, "save")
    path = check_path(path, "save")
    obj = consolidated_states(backend, obj)  # sharded optimizers: every rank takes part in consolidating their state
    # Rank 0 writes inside the collective: the others wait in it, not before it (no stall report).
    what = f"save: could not write the checkpoint {path!r}"
    run_on_root(backend, lambda: write_atomic(state_of(obj), path), what=what)


def load(backend: Backend, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
    """Read the checkpoint at ``path`` on rank 0 and return it on every rank.

    Rank 0 first checks every record of the file against the CRC-32 that ``torch.save``
    wrote (``torch.load`` does not check them: a flipped bit would load as a wrong
    value), then reads it with ``torch.load(..., map_location="cpu",
    weights_only=weights_only)`` and broadcasts the object (its tensors' storages as raw
    buffers, not pickled), so only rank 0 needs to see the file. The check reads the file
    once more (about 0.3-0.4 s per GiB, mostly from the page cache). Files without
    CRC-32s load unchecked: torch's legacy format and files
    written with ``torch.serialization.set_crc32_options(False)`` (``dml.save`` always
    writes them). Tensors arrive on the CPU; ``load_state_dict`` copies them to the
    parameters' devices.

    Args:
        backend: from ``dml.get_distributed_backend``.
        path: the checkpoint file.
        weights_only: load only tensors, containers and plain values (``torch.load``'s
            safe mode, the default), and NumPy arrays, scalars and dtypes (whose contents
            are unpickled under the same rules); classes allowed with
            ``torch.serialization.add_safe_globals`` too. Pass False only for a file you
            trust that holds other classes.

    Returns:
        The saved object, an independent copy on every rank.

    Raises:
        TypeError: ``backend`` is not a backend instance, ``path`` is not a str or
            os.PathLike, or ``weights_only`` is not a bool (raised before any communication).
        ValueError: ``path`` is empty.
        FileNotFoundError: no file at ``path`` on rank 0, raised on every rank.
        RuntimeError: the file is corrupted (a record fails its CRC-32 check, or the zip
            structure is damaged), raised on every rank: ``"load: could not read the
            checkpoint '<path>': rank 0: RuntimeError: the file is corrupted (...)"``.
        Exception: any other failure to read on rank 0 (``pickle.UnpicklingError`` for
            a class that ``weights_only`` rejects), raised with the same class on every
            rank, naming ``path`` and rank 0's error.

    Restore a checkpoint as the exact-resume recipe does (docs/reliability.md, "Exact
    resume"): ``load_state_dict`` for each live object, ``set_epoch`` for a container (before
    its loader's state), and ``dml.set_rng_state_all`` for the random streams.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> dml.save(backend, {"model": model, "opt": opt, "step": 10, "rng": dml.rng_state_all(backend)}, "ckpt.pt")
        >>> ckpt = dml.load(backend, "ckpt.pt")  # read by rank 0, broadcast to every rank
        >>> model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"]); ckpt["step"]
        <All keys matched successfully>
        10
        >>> dml.set_rng_state_all(backend, ckpt["rng"])  # this rank's streams, as they were at the save
    """
    check_backend(backend, "load")
    path = check_path(path, "load")
    if not isinstance(weights_only, bool):
        raise TypeError(f"load: weights_only: got {type(weights_only).__qualname__}; allowed: True or False")
    # Rank 0 reads inside the collective: the others wait in it, not before it (no stall report).
    return run_on_root(
        backend, lambda: _read_verified(path, weights_only), what=f"load: could not read the checkpoint {path!r}"
    )
