"""Collectives, backend first: ``allreduce``, ``bcast``, ``reduce``, ``allgather``, ``reduce_scatter``, ``barrier``.

Every argument is checked on the calling rank before any byte is sent, so a bad call
raises on that rank and leaves the world usable. Buffers are NumPy arrays, torch
tensors (CPU or CUDA) or CuPy arrays (:mod:`distutils_ml.arrays`); results land in the
caller's buffer. Any size: backends move large buffers in pieces.

One thread at a time: a collective entered while another thread of this process is
inside one on the same backend raises ``RuntimeError`` naming both threads (before
anything is sent), since ranks would pair up the two threads' messages differently.
In debug mode every call is compared across ranks first (``Backend._check_call``).
"""

from __future__ import annotations

import operator
from typing import Any, TypeVar, overload

import numpy as np
import torch

from distutils_ml.arrays import (
    HALF_DTYPES,
    OP_DTYPE_OK,
    OnDevice,
    check_op_dtype,
    cuda_tensor,
    not_contiguous,
    pinned_like,
    result_view,
    source_view,
    to_float32,
    torch_dtype_name,
    write_back,
)
from distutils_ml.backends.base import Backend, ReduceOp, check_backend, resolve_op

__all__ = ["allreduce", "bcast", "reduce", "allgather", "reduce_scatter", "barrier"]

T = TypeVar("T")
_SUM, _AVG = ReduceOp.SUM, ReduceOp.AVG


def check_root(backend: Backend, root: Any) -> int:
    """``root`` as an int in ``0 .. backend.size - 1`` (checked before any rooted collective sends).

    Raises:
        TypeError: ``root`` is not an int (a bool is refused too).
        ValueError: ``root`` is outside ``0 .. total_workers - 1``.
    """
    try:
        if isinstance(root, bool):
            raise TypeError
        r = operator.index(root)
    except TypeError:
        raise TypeError(f"root: got {root!r}; allowed: an int in 0..{backend.size - 1}") from None
    if not 0 <= r < backend.size:
        raise ValueError(f"root: got {r}; allowed: 0..{backend.size - 1} (total_workers is {backend.size})")
    return r


def _check_match(send: np.ndarray, sdt: str, recv: np.ndarray, rdt: str, shape: tuple[int, ...]) -> None:
    if recv.shape != shape:
        raise ValueError(f"recvbuf: got shape {tuple(recv.shape)}, expected {shape} (from sendbuf {tuple(send.shape)})")
    if sdt != rdt:
        raise ValueError(f"recvbuf: got dtype {rdt}, expected sendbuf's dtype {sdt}")


def _two_buffers(sendbuf: Any, recvbuf: Any) -> tuple[np.ndarray | None, np.ndarray, str]:
    """Views of (sendbuf, recvbuf); sendbuf None when both are one buffer (in place)."""
    recv, dt = result_view(recvbuf, "recvbuf")
    if sendbuf is recvbuf:
        return None, recv, dt
    send, sdt = source_view(sendbuf, "sendbuf", recv)
    _check_match(send, sdt, recv, dt, tuple(send.shape))
    return send, recv, dt


def _split_op(recvbuf: Any, op: Any) -> tuple[Any, Any]:
    if op is None:
        if recvbuf is None:
            raise TypeError("op: missing; pass one of dml.SUM, dml.PROD, dml.MAX, dml.MIN, dml.AVG")
        return None, recvbuf
    return recvbuf, op


@overload
def allreduce(backend: Backend, buf: T, op: Any, /) -> T: ...
@overload
def allreduce(backend: Backend, sendbuf: Any, recvbuf: T, op: Any, /) -> T: ...
def allreduce(backend: Backend, sendbuf: Any, recvbuf: Any = None, op: Any = None) -> Any:
    """Reduce a buffer across all ranks; every rank gets the result.

    ``allreduce(backend, buf, op)`` works in place and returns ``buf``;
    ``allreduce(backend, sendbuf, recvbuf, op)`` writes into and returns ``recvbuf``.

    Args:
        backend: from ``dml.get_distributed_backend``.
        sendbuf: NumPy array, torch tensor (CPU or CUDA) or CuPy array (the in-place
            buffer in the 3-argument form).
        recvbuf: result buffer of the same shape and dtype.
        op: ``dml.SUM``, ``PROD``, ``MAX``, ``MIN``, ``AVG`` (or ``"sum"``, ``operator.add``, ``max``...).

    Example:
        >>> grads = torch.tensor([1.0, 2.0])
        >>> dml.allreduce(backend, grads, dml.AVG)  # in a world of one: the identity
        tensor([1., 2.])
        >>> out = np.empty(2)
        >>> dml.allreduce(backend, np.array([3.0, 4.0]), out, "sum")
        array([3., 4.])
    """
    check_backend(backend, "allreduce")
    backend._enter("allreduce")  # one thread at a time: after the communication thread's jobs, or refused
    try:
        if op is None:
            recvbuf, op = _split_op(recvbuf, op)
        if type(op) is not ReduceOp:
            op = resolve_op(op)
        try:
            if recvbuf is None:
                send, (recv, dt) = None, result_view(sendbuf, "buf")
                out = sendbuf
            else:
                send, recv, dt = _two_buffers(sendbuf, recvbuf)
                out = recvbuf
        except OnDevice:
            return _on_device("allreduce", backend, sendbuf, recvbuf, op)
        if (op, dt) not in OP_DTYPE_OK:
            check_op_dtype(op, dt, "buf" if recvbuf is None else "sendbuf")
        if backend.debug:
            backend._check_call("allreduce", recv.shape, dt, op, -1)
        if dt in HALF_DTYPES and not backend.native_half_reductions:
            work = to_float32(out, recv) if send is None else to_float32(sendbuf, send)
            _allreduce_native(backend, None, work, op)
            write_back(out, recv, work)
        elif op is not _AVG or backend.native_avg:
            backend._allreduce(send, recv, op)
        else:
            _allreduce_native(backend, send, recv, op)
        return out
    finally:
        backend._leave()


def _allreduce_native(backend: Backend, send: np.ndarray | None, recv: np.ndarray, op: ReduceOp) -> None:
    if op is _AVG and not backend.native_avg:
        backend._allreduce(send, recv, _SUM)
        np.divide(recv, backend.size, out=recv)
    else:
        backend._allreduce(send, recv, op)


@overload
def bcast(backend: Backend, buf: T, /, *, root: int = 0) -> T: ...
@overload
def bcast(backend: Backend, sendbuf: Any, recvbuf: T, /, *, root: int = 0) -> T: ...
def bcast(backend: Backend, sendbuf: Any, recvbuf: Any = None, *, root: int = 0) -> Any:
    """Give every rank root's data.

    ``bcast(backend, buf, root=0)`` overwrites ``buf`` in place on non-root ranks and
    returns it; ``bcast(backend, sendbuf, recvbuf, root=0)`` fills ``recvbuf`` on every
    rank, root included, from root's ``sendbuf`` (other ranks' ``sendbuf`` is not read).

    Example:
        >>> weights = torch.zeros(3)
        >>> dml.bcast(backend, weights, root=0)  # every rank ends with rank 0's weights
        tensor([0., 0., 0.])
    """
    check_backend(backend, "bcast")
    root = check_root(backend, root)
    backend._enter("bcast")
    try:
        return _bcast(backend, sendbuf, recvbuf, root)
    finally:
        backend._leave()


def _bcast(backend: Backend, sendbuf: Any, recvbuf: Any, root: int) -> Any:
    try:
        if recvbuf is None:
            buf, dt = result_view(sendbuf, "buf")
        else:
            send, buf, dt = _two_buffers(sendbuf, recvbuf)
    except OnDevice:
        return _on_device("bcast", backend, sendbuf, recvbuf, None, root)
    root = backend.acting_root(root)  # a joined root's data comes from a rank with data (dml.join)
    if backend.debug:
        backend._check_call("bcast", buf.shape, dt, None, root)
    if recvbuf is None:
        backend._bcast(buf, root)
        return sendbuf
    if send is not None and backend.rank == root:
        np.copyto(buf, send)
    backend._bcast(buf, root)
    return recvbuf


@overload
def reduce(backend: Backend, buf: T, op: Any, /, *, root: int = 0) -> T: ...
@overload
def reduce(backend: Backend, sendbuf: Any, recvbuf: T, op: Any, /, *, root: int = 0) -> T: ...
def reduce(backend: Backend, sendbuf: Any, recvbuf: Any = None, op: Any = None, *, root: int = 0) -> Any:
    """Reduce a buffer across all ranks onto ``root``.

    ``reduce(backend, buf, op, root=0)`` leaves the result in root's ``buf``; other
    ranks' ``buf`` are unchanged. ``reduce(backend, sendbuf, recvbuf, op, root=0)``
    writes root's ``recvbuf``; other ranks' ``recvbuf`` are untouched.

    Example:
        >>> loss_sum = np.array(1.5)
        >>> dml.reduce(backend, loss_sum, dml.SUM, root=0)  # rank 0 gets the total
        array(1.5)
    """
    check_backend(backend, "reduce")
    recvbuf, op = _split_op(recvbuf, op)
    op = resolve_op(op)
    root = check_root(backend, root)
    backend._enter("reduce")
    try:
        return _reduce(backend, sendbuf, recvbuf, op, root)
    finally:
        backend._leave()


def _reduce(backend: Backend, sendbuf: Any, recvbuf: Any, op: ReduceOp, root: int) -> Any:
    try:
        if recvbuf is None:
            send, (recv, dt) = None, result_view(sendbuf, "buf")
            out = sendbuf
        else:
            send, recv, dt = _two_buffers(sendbuf, recvbuf)
            out = recvbuf
    except OnDevice:
        return _on_device("reduce", backend, sendbuf, recvbuf, op, root)
    check_op_dtype(op, dt, "buf" if recvbuf is None else "sendbuf")
    root = backend.acting_root(root)  # a joined root's result goes to a rank with data (dml.join)
    if backend.debug:
        backend._check_call("reduce", recv.shape, dt, op, root)
    is_root = backend.rank == root
    if dt in HALF_DTYPES and not backend.native_half_reductions:
        work = to_float32(out, recv) if send is None else to_float32(sendbuf, send)
        _reduce_native(backend, None, work, op, root)
        if is_root:
            write_back(out, recv, work)
    else:
        _reduce_native(backend, send, recv, op, root)
    return out


def _reduce_native(backend: Backend, send: np.ndarray | None, recv: np.ndarray, op: ReduceOp, root: int) -> None:
    if op is _AVG and not backend.native_avg:
        backend._reduce(send, recv, _SUM, root)
        if backend.rank == root:
            np.divide(recv, backend.size, out=recv)
    else:
        backend._reduce(send, recv, op, root)


def allgather(backend: Backend, sendbuf: Any, recvbuf: T) -> T:
    """Gather every rank's ``sendbuf`` into ``recvbuf`` on every rank.

    ``recvbuf`` has a leading axis of size ``total_workers``: ``recvbuf[k]`` is rank
    k's ``sendbuf``.

    Example:
        >>> x = torch.tensor([1.0, 2.0])
        >>> out = torch.empty(dml.total_workers(backend), *x.shape)
        >>> dml.allgather(backend, x, out)
        tensor([[1., 2.]])
    """
    check_backend(backend, "allgather")
    backend._enter("allgather")
    try:
        try:
            recv, rdt = result_view(recvbuf, "recvbuf")
            send, sdt = source_view(sendbuf, "sendbuf", recv)
        except OnDevice:
            return _on_device("allgather", backend, sendbuf, recvbuf)
        _check_match(send, sdt, recv, rdt, (backend.size, *send.shape))
        if backend.debug:
            backend._check_call("allgather", send.shape, sdt, None, -1)
        backend._allgather(send, recv)
        return recvbuf
    finally:
        backend._leave()


@overload
def reduce_scatter(backend: Backend, buf: Any, op: Any, /) -> Any: ...
@overload
def reduce_scatter(backend: Backend, sendbuf: Any, recvbuf: T, op: Any, /) -> T: ...
def reduce_scatter(backend: Backend, sendbuf: Any, recvbuf: Any = None, op: Any = None) -> Any:
    """Reduce across ranks and give each rank one row of the result: the mirror of :func:`allgather`.

    ``sendbuf`` has a leading axis of size ``total_workers``: ``sendbuf[k]`` is this rank's
    contribution to rank k's result. ``reduce_scatter(backend, sendbuf, recvbuf, op)`` writes
    the op over ranks of every rank's ``sendbuf[rank]`` into ``recvbuf`` (shape
    ``sendbuf.shape[1:]``) and returns it; ``sendbuf`` is not changed. The in-place form
    ``reduce_scatter(backend, buf, op)`` writes that result into ``buf[rank]`` and returns
    that row (a view); the other rows of ``buf`` are left unchanged.

    A flat buffer is not split for you: to scatter ``W * n`` elements, pass
    ``buf.view(W, n)`` (torch) or ``buf.reshape(W, n)`` (NumPy), views that cost no copy;
    each rank then receives its ``n`` contiguous elements (its shard). The same view
    turns a flat buffer into :func:`allgather`'s ``recvbuf``.

    Args:
        backend: from ``dml.get_distributed_backend``.
        sendbuf: NumPy array, torch tensor (CPU or CUDA) or CuPy array with a leading axis
            of size ``total_workers`` (the in-place buffer in the 3-argument form).
        recvbuf: result buffer of shape ``sendbuf.shape[1:]`` and ``sendbuf``'s dtype.
        op: ``dml.SUM``, ``PROD``, ``MAX``, ``MIN``, ``AVG`` (or ``"sum"``, ``operator.add``, ``max``...),
            on the dtypes ``allreduce`` takes them.

    Returns:
        ``recvbuf``, or in place the view ``buf[rank]``.

    Raises:
        ValueError: ``sendbuf``'s leading axis is not ``total_workers`` (a flat buffer
            included), ``recvbuf``'s shape or dtype does not match, the buffers overlap,
            or a result buffer is not contiguous or read-only.
        TypeError: an unsupported buffer or dtype, or an op the dtype does not allow.

    Example:
        >>> w, rank = dml.total_workers(backend), dml.local_rank(backend)
        >>> grads = torch.ones(w * 3)  # this rank's full gradient
        >>> shard = torch.empty(3)
        >>> dml.reduce_scatter(backend, grads.view(w, -1), shard, dml.AVG)  # the average of this rank's shard
        tensor([1., 1., 1.])
    """
    check_backend(backend, "reduce_scatter")
    recvbuf, op = _split_op(recvbuf, op)
    op = resolve_op(op)
    backend._enter("reduce_scatter")
    try:
        return _reduce_scatter(backend, sendbuf, recvbuf, op)
    finally:
        backend._leave()


def _scatter_rows(backend: Backend, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """The shape of one rank's result, after checking that ``shape`` leads with an axis of ``total_workers``."""
    w = backend.size
    if shape and shape[0] == w:
        return tuple(shape[1:])
    need = f"reduce_scatter needs a leading axis of size total_workers ({w}), where {name}[k] goes to rank k"
    if not shape:
        raise ValueError(f"{name}: got a 0-d buffer; {need}")
    if len(shape) == 1 and shape[0] % w == 0:
        n = shape[0] // w
        raise ValueError(
            f"{name}: got shape {tuple(shape)}, a flat buffer; {need}, and flat buffers are not split: pass "
            f"{name}.view({w}, -1) (torch) or {name}.reshape({w}, -1) (NumPy), views of shape ({w}, {n})"
        )
    raise ValueError(f"{name}: got shape {tuple(shape)}; {need}: shape ({w}, ...)")


def _reduce_scatter(backend: Backend, sendbuf: Any, recvbuf: Any, op: ReduceOp) -> Any:
    try:
        if recvbuf is None:
            send, dt = result_view(sendbuf, "buf")
            _scatter_rows(backend, send.shape, "buf")
            recv = None
        else:
            if sendbuf is recvbuf:
                raise ValueError(
                    "sendbuf and recvbuf are the same buffer; for the in-place form pass it once: "
                    "dml.reduce_scatter(backend, buf, op) (the result lands in buf[rank])"
                )
            recv, dt = result_view(recvbuf, "recvbuf")
            send, sdt = source_view(sendbuf, "sendbuf", recv)
            _check_match(send, sdt, recv, dt, _scatter_rows(backend, send.shape, "sendbuf"))
    except OnDevice:
        return _on_device("reduce_scatter", backend, sendbuf, recvbuf, op)
    check_op_dtype(op, dt, "buf" if recvbuf is None else "sendbuf")
    if backend.debug:
        backend._check_call("reduce_scatter", send.shape, dt, op, -1)
    rank = backend.rank
    out = sendbuf[rank, ...] if recvbuf is None else recvbuf
    if dt in HALF_DTYPES and not backend.native_half_reductions:
        work = to_float32(sendbuf, send)
        _reduce_scatter_native(backend, work, None, op)
        write_back(out, send[rank, ...] if recv is None else recv, work[rank, ...])
    else:
        _reduce_scatter_native(backend, send, recv, op)
    return out


def _reduce_scatter_native(backend: Backend, send: np.ndarray, recv: np.ndarray | None, op: ReduceOp) -> None:
    if op is _AVG and not backend.native_avg:
        backend._reduce_scatter(send, recv, _SUM)
        target = send[backend.rank, ...] if recv is None else recv
        np.divide(target, backend.size, out=target)
    else:
        backend._reduce_scatter(send, recv, op)


def barrier(backend: Backend) -> None:
    """Return once every rank has called ``barrier``."""
    check_backend(backend, "barrier")
    backend._enter("barrier")
    try:
        if backend.debug:
            backend._check_call("barrier", None, None, None, -1)
        backend._barrier()
    finally:
        backend._leave()


# -- CUDA buffers -------------------------------------------------------------------------


def _on_device(  # noqa: PLR0917 - private; mirrors the public collectives' arguments
    kind: str, backend: Backend, sendbuf: Any, recvbuf: Any, op: ReduceOp | None = None, root: int = 0
) -> Any:
    """A collective on CUDA buffers: the backend's device path (NCCL, CUDA-aware MPI), or staged through host memory.

    Work is ordered after everything queued on the producer's current CUDA stream (torch's
    for tensors, CuPy's for CuPy arrays, so the caller's later work on it sees the result):
    copies and NCCL calls run on it, and MPI only touches memory after it is synchronized.
    """
    out = sendbuf if recvbuf is None else recvbuf
    if isinstance(out, torch.Tensor):
        return _on_stream(kind, backend, sendbuf, recvbuf, op, root)
    import cupy  # a CUDA array that is not a tensor: CuPy's (or another library's) array

    device = torch.device("cuda", out.device.id)  # the array's GPU, not merely the current one
    with cupy.cuda.Device(out.device.id):  # CuPy's current stream of that GPU (each GPU has its own)
        ptr = cupy.cuda.get_current_stream().ptr
    stream = torch.cuda.default_stream(device) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=device)
    with torch.cuda.stream(stream):
        return _on_stream(kind, backend, sendbuf, recvbuf, op, root)


def check_device(backend: Backend, buf: Any, name: str) -> None:
    """Raise ``ValueError`` unless CUDA tensor ``buf`` is on the GPU that ``backend``'s device path is bound to."""
    index = buf.device.index
    if backend.device is not None and index != backend.device:
        raise ValueError(
            f"{name}: a buffer on cuda:{index}, but {type(backend).__name__}'s communicator on rank "
            f"{backend.rank} is on cuda:{backend.device}; move the buffer there (.to('cuda:{backend.device}')) "
            f"or make that device current before creating it (torch.cuda.set_device({backend.device}))"
        )


def _on_stream(  # noqa: PLR0917 - private; mirrors the public collectives' arguments
    kind: str, backend: Backend, sendbuf: Any, recvbuf: Any, op: ReduceOp | None, root: int
) -> Any:
    """``_on_device`` on torch's current stream."""
    out = sendbuf if recvbuf is None else recvbuf
    rname = "buf" if recvbuf is None else "recvbuf"
    recv = cuda_tensor(out, rname)
    if not recv.is_contiguous():
        raise not_contiguous(rname, recv.shape)
    send = None
    if kind == "reduce_scatter" and recvbuf is None:
        _scatter_rows(backend, tuple(recv.shape), "buf")
    if recvbuf is not None and sendbuf is not recvbuf:
        send = cuda_tensor(sendbuf, "sendbuf").contiguous()
        if kind == "allgather":
            shape = (backend.size, *send.shape)
        elif kind == "reduce_scatter":
            shape = _scatter_rows(backend, tuple(send.shape), "sendbuf")
        else:
            shape = tuple(send.shape)
        if tuple(recv.shape) != shape:
            raise ValueError(
                f"recvbuf: got shape {tuple(recv.shape)}, expected {shape} (from sendbuf {tuple(send.shape)})"
            )
        if send.dtype != recv.dtype:
            raise ValueError(
                f"recvbuf: got dtype {torch_dtype_name(recv)}, expected sendbuf's dtype {torch_dtype_name(send)}"
            )
        if send.device != recv.device:
            raise ValueError(f"sendbuf is on {send.device} and recvbuf on {recv.device}; pass buffers on one device")
    if op is not None:
        check_op_dtype(op, torch_dtype_name(recv), "buf" if send is None else "sendbuf")
    result = out[backend.rank, ...] if kind == "reduce_scatter" and send is None else out
    if backend.takes_device_buffers:
        check_device(backend, recv, rname)
        if backend.debug:
            shape = tuple((send if kind in ("allgather", "reduce_scatter") and send is not None else recv).shape)
            backend._check_call(kind, shape, torch_dtype_name(recv), op, root if kind in ("bcast", "reduce") else -1)
        backend._device_collective(kind, send, recv, op, root)
        return result
    # Staged: copy to reused pinned host buffers (the copy waits for the current stream), run
    # the host collective, copy back.
    host_recv = pinned_like(backend, "recv", recv)
    host_recv.copy_(recv)
    host_send = None
    if send is not None:
        host_send = pinned_like(backend, "send", send)
        host_send.copy_(send)
    if kind == "allreduce":
        allreduce(backend, host_recv, op) if host_send is None else allreduce(backend, host_send, host_recv, op)
    elif kind == "reduce":
        if host_send is None:
            reduce(backend, host_recv, op, root=root)
        else:
            reduce(backend, host_send, host_recv, op, root=root)
    elif kind == "bcast":
        bcast(backend, host_recv, root=root) if host_send is None else bcast(backend, host_send, host_recv, root=root)
    elif kind == "reduce_scatter":
        if host_send is None:
            reduce_scatter(backend, host_recv, op)
        else:
            reduce_scatter(backend, host_send, host_recv, op)
    else:
        allgather(backend, host_send, host_recv)
    recv.copy_(host_recv)
    return result
