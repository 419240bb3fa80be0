"""NCCLBackend: collectives on CUDA buffers through NCCL (CuPy's bindings), bootstrapped over MPI.

``dml.initialize(dml.NCCLBackend)`` initializes MPI first (``initialized(MPIBackend)``
is then true too), puts this process on a GPU (``cuda_devices``), creates the NCCL
unique id on rank 0 and broadcasts it over MPI, and builds one communicator.

CUDA buffers (torch CUDA tensors, CuPy arrays) go through NCCL (``ncclAllReduce``,
``ncclReduce``, ``ncclBroadcast``, ``ncclAllGather``, ``ncclReduceScatter``) on torch's current
CUDA stream, so they are ordered after the kernels that produced them; float16 and
bfloat16 reduce natively and ``AVG`` maps to NCCL's ``ncclAvg`` (NCCL >= 2.10). CPU
buffers and Python objects go through the MPI backend (Lux's design), so
``synchronize`` of a mixed tree works.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.backends.mpi import MPIBackend

__all__ = ["NCCLBackend"]

# ncclDataType_t and ncclRedOp_t, as numbered in nccl.h (stable across NCCL 2.x).
_NCCL_DTYPES = {
    torch.int8: 0,
    torch.bool: 1,  # as uint8
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
_NCCL_AVG_VERSION = 21000
_MAX_BCAST_COUNT = 2**31 - 1


def _import_nccl() -> Any:
    try:
        import cupy  # noqa: F401 - CuPy must import for its NCCL bindings
        from cupy.cuda import nccl
    except ImportError as e:
        raise ImportError(
            f'NCCLBackend needs CuPy with NCCL ({e}); install them with: pip install "distutils-ml[cuda]" '
            '(CUDA 12) or pip install "distutils-ml[cuda13]" (CUDA 13)'
        ) from e
    if not nccl.available:
        raise ImportError(
            "NCCLBackend: CuPy is installed but the NCCL library (libnccl.so.2) was not found; "
            'install it with: pip install "distutils-ml[cuda]" (brings nvidia-nccl-cu12)'
        )
    return nccl


def _pick_device(cuda_devices: Any, node_local_rank: int, node_size: int, rank: int) -> int | None:
    """The GPU this process uses: ``node_local_rank % n_gpus``, a list entry, or None (leave alone)."""
    if cuda_devices is False:
        return None
    if not (cuda_devices is None or isinstance(cuda_devices, (list, tuple))):
        raise TypeError(f"cuda_devices: got {cuda_devices!r}; allowed: None, a list of device indices, or False")
    if torch.version.cuda is None:
        raise RuntimeError(
            f"NCCLBackend: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch "
            "on the GPU machine, or use dml.MPIBackend"
        )
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise RuntimeError(
            f"NCCLBackend: rank {rank} sees no CUDA device (CUDA_VISIBLE_DEVICES={visible}); "
            "NCCL needs a GPU per process: run on a GPU machine, or use dml.MPIBackend"
        )
    if cuda_devices is None:
        if node_size > n:
            raise RuntimeError(
                f"NCCLBackend: {node_size} processes on this node but {n} GPU(s) visible; NCCL needs one GPU per "
                f"process (two ranks on one GPU fail with 'Duplicate GPU detected'): start at most {n} processes "
                "per node, or use dml.MPIBackend (it stages CUDA buffers through host memory)"
            )
        return node_local_rank % n  # == node_local_rank here: the contract's rule
    if node_local_rank >= len(cuda_devices):
        raise ValueError(
            f"cuda_devices: got {list(cuda_devices)} for node-local rank {node_local_rank}; "
            "give one device per process of the node"
        )
    device = int(cuda_devices[node_local_rank])
    if not 0 <= device < n:
        raise ValueError(
            f"cuda_devices: device {device} for node-local rank {node_local_rank}; this node has 0..{n - 1}"
        )
    return device


class NCCLBackend(Backend):
    """NCCL for CUDA buffers, MPI for host buffers and Python objects.

    Args:
        mpi_backend: the MPI backend that bootstraps NCCL and carries host buffers
            (default: the process's ``MPIBackend``, initialized if needed).
        cuda_devices: None (default) takes GPU ``node_local_rank % n_gpus``; a list
            gives the device of each node-local rank; False leaves devices alone.
        **mpi_options: passed to ``initialize(MPIBackend, ...)`` when it is not yet initialized.
    """

    takes_device_buffers = True
    native_avg = True  # host buffers: the MPI backend sums and divides per segment

    def __init__(self, *, mpi_backend: MPIBackend | None = None, cuda_devices: Any = None, **mpi_options: Any) -> None:
        super().__init__()
        nccl = _import_nccl()
        if mpi_backend is None:
            from distutils_ml.registry import get_distributed_backend, initialize

            initialize(MPIBackend, **mpi_options)
            mpi_backend = get_distributed_backend(MPIBackend)
        self.mpi = mpi_backend
        self.debug = mpi_backend.debug
        self.device = _pick_device(cuda_devices, mpi_backend.node_local_rank, mpi_backend.node_size, mpi_backend.rank)
        if self.device is not None:
            torch.cuda.set_device(self.device)
            import cupy

            cupy.cuda.Device(self.device).use()
        uid = nccl.get_unique_id() if mpi_backend.rank == 0 else None
        uid = mpi_backend._bcast_object(uid, 0)
        self.nccl_comm = nccl.NcclCommunicator(mpi_backend.size, uid, mpi_backend.rank)
        self.nccl_version = int(nccl.get_version())

    @property
    def rank(self) -> int:
        return self.mpi.rank

    @property
    def size(self) -> int:
        return self.mpi.size

    # -- host buffers and objects: the MPI backend ---------------------------------------

    def _allreduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp) -> None:
        self.mpi._allreduce(sendbuf, recvbuf, op)

    def _bcast(self, buf: np.ndarray, root: int) -> None:
        self.mpi._bcast(buf, root)

    def _reduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp, root: int) -> None:
        self.mpi._reduce(sendbuf, recvbuf, op, root)

    def _allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        self.mpi._allgather(sendbuf, recvbuf)

    def _reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp) -> None:
        self.mpi._reduce_scatter(sendbuf, recvbuf, op)

    def _barrier(self) -> None:
        self.mpi._barrier()

    def _bcast_bytes(self, data: bytes | None, root: int, make: Callable[[], bytes] | None = None) -> bytes:
        return self.mpi._bcast_bytes(data, root, make)

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        return self.mpi._allgather_bytes(data)

    def _abort(self, message: str) -> NoReturn:
        self.mpi._abort(message)

    def _check_call(self, kind: str, shape: Any, dtype: str | None, op: ReduceOp | None, root: int) -> None:
        self.mpi._check_call(kind, shape, dtype, op, root)

    # -- CUDA buffers: NCCL ------------------------------------------------------------------

    def _device_collective(
        self, kind: str, send: torch.Tensor | None, recv: torch.Tensor, op: ReduceOp | None, root: int
    ) -> None:
        dtype = _NCCL_DTYPES.get(recv.dtype)
        if dtype is None:  # int16: NCCL has no 16-bit integers; move the bytes for data movement
            if op is not None:
                raise TypeError(f"NCCL cannot reduce {recv.dtype} buffers; use int32 or a float dtype")
            dtype, scale = 0, recv.element_size()
        else:
            scale = 1
        stream = torch.cuda.current_stream(recv.device).cuda_stream
        rptr = recv.data_ptr()
        sptr = rptr if send is None else send.data_ptr()
        comm = self.nccl_comm
        if kind == "allgather":
            assert send is not None
            comm.allGather(sptr, rptr, send.numel() * scale, dtype, stream)
            return
        count = recv.numel() * scale
        if kind == "bcast":
            if send is not None and self.rank == root:
                recv.copy_(send)
            # CuPy's bcast takes a C int count: send larger buffers (fused model broadcasts) in pieces.
            step = _MAX_BCAST_COUNT - _MAX_BCAST_COUNT % 16
            for start in range(0, count, step):
                n = min(step, count - start)
                comm.bcast(rptr + start * (recv.element_size() // scale), n, dtype, root, stream)
            return
        assert op is not None
        avg_native = op is not ReduceOp.AVG or self.nccl_version >= _NCCL_AVG_VERSION
        nop = _NCCL_OPS[op if avg_native else ReduceOp.SUM]
        if kind == "reduce_scatter":
            # In place is NCCL's own form: recvbuff == sendbuff + rank * recvcount (other rows are only read).
            row = recv[self.rank] if send is None else recv
            if row.numel():
                comm.reduceScatter(sptr, row.data_ptr(), row.numel(), dtype, nop, stream)
                if not avg_native:
                    row.div_(self.size)
            return
        if kind == "allreduce":
            comm.allReduce(sptr, rptr, count, dtype, nop, stream)
            if not avg_native:
                recv.div_(self.size)
            return
        # reduce: NCCL writes recvbuf on root only; in place on non-root, send from recv.
        comm.reduce(sptr, rptr, count, dtype, nop, root, stream)
        if not avg_native and self.rank == root:
            recv.div_(self.size)
