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

import atexit
import os
import pickle
import weakref
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
_SHARE_ENV = "DML_NCCL_SHARE_DEVICE"


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


def _share_option(share_device: bool | None) -> bool:
    if share_device is None:
        text = os.environ.get(_SHARE_ENV, "").strip().lower()
        if text not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"{_SHARE_ENV}: got {text!r}; allowed: 1 (share) or 0 (one GPU per process, the default)")
        return text in ("1", "true", "yes", "on")
    if not isinstance(share_device, bool):
        raise TypeError(f"share_device: got {share_device!r}; allowed: True, False or None ({_SHARE_ENV})")
    return share_device


def _visible_gpus() -> tuple[list[str], str | None]:
    """This process's visible GPUs as physical ids (UUIDs), and a problem that stops NCCL here (or None)."""
    if torch.version.cuda is None:
        return [], (
            f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch on the GPU "
            "machine, or use dml.MPIBackend"
        )
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return [], (
            f"sees no CUDA device (CUDA_VISIBLE_DEVICES={visible}); NCCL needs a GPU per process: run on a GPU "
            "machine, or use dml.MPIBackend"
        )
    return [_gpu_id(i) for i in range(n)], None


def _gpu_id(index: int) -> str:
    """A physical GPU's identity, the same whichever CUDA_VISIBLE_DEVICES numbering a process sees it under."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    return f"PCI {getattr(props, 'pci_domain_id', 0)}:{getattr(props, 'pci_bus_id', index)}:{props.pci_device_id}"


def choose_devices(
    cuda_devices: Any, visible: list[list[str]], hosts: list[str], node_local: list[int]
) -> list[int | str]:
    """The device index each rank takes (a str: that rank's error), from every rank's visible GPUs.

    ``visible[r]`` lists rank r's visible GPUs (their UUIDs, in CUDA's numbering); ``hosts[r]`` its node;
    ``node_local[r]`` its rank within the node. With ``cuda_devices`` None: where the ranks of a node see
    the same GPUs, ``node_local_rank % n_gpus`` (the contract's rule); where each sees its own (SLURM
    ``--gpus-per-task``, ``CUDA_VISIBLE_DEVICES`` set per rank), the first of its GPUs that no lower rank
    of the node took. A list gives the device of each node-local rank.
    """
    chosen: list[int | str] = []
    taken: dict[str, set[str]] = {}
    for r, gpus in enumerate(visible):
        n = len(gpus)
        if n == 0:
            chosen.append("no GPU")
            continue
        local = node_local[r]
        if cuda_devices is None:
            same = all(visible[q] == gpus for q in range(len(visible)) if hosts[q] == hosts[r])
            mine = taken.setdefault(hosts[r], set())
            free = [i for i, g in enumerate(gpus) if g not in mine]
            index = local % n if same or not free else free[0]
        elif local >= len(cuda_devices):
            chosen.append(
                f"cuda_devices: got {list(cuda_devices)} for node-local rank {local}; give one device per "
                "process of the node"
            )
            continue
        else:
            index = int(cuda_devices[local])
            if not 0 <= index < n:
                chosen.append(f"cuda_devices: device {index} for node-local rank {local}; this node has 0..{n - 1}")
                continue
        taken.setdefault(hosts[r], set()).add(gpus[index])
        chosen.append(index)
    return chosen


def shared_gpus(gpu_of: list[str | None], hosts: list[str]) -> str | None:
    """A message naming the ranks that would drive one physical GPU (``gpu_of[r]``: rank r's GPU), or None."""
    ranks: dict[str, list[int]] = {}
    for r, gpu in enumerate(gpu_of):
        if gpu is not None:
            ranks.setdefault(gpu, []).append(r)
    clashes = {gpu: rs for gpu, rs in ranks.items() if len(rs) > 1}
    if not clashes:
        return None
    gpu, rs = next(iter(clashes.items()))
    host = hosts[rs[0]]
    on_host = sum(h == host for h in hosts)
    gpus = len({g for g, h in zip(gpu_of, hosts, strict=True) if h == host and g is not None})
    return (
        f"ranks {rs} on {host} would drive the same GPU ({gpu}): {on_host} processes but {gpus} GPU(s) among "
        "them on that node. NCCL needs one GPU per process (it fails with 'Duplicate GPU detected'): start at "
        "most one process per GPU, give each process its own GPU (CUDA_VISIBLE_DEVICES per rank, SLURM "
        "--gpus-per-task=1), or use dml.MPIBackend (it stages CUDA buffers through host memory). To rehearse "
        f"a multi-rank NCCL job on one GPU (a test, not for speed), set {_SHARE_ENV}=1 on every rank"
    )


class NCCLBackend(Backend):
    """NCCL for CUDA buffers, MPI for host buffers and Python objects.

    Args:
        mpi_backend: the MPI backend that bootstraps NCCL and carries host buffers
            (default: the process's ``MPIBackend``, initialized if needed).
        cuda_devices: None (default) takes GPU ``node_local_rank % n_gpus`` where the ranks of a node
            see the same GPUs, else each rank's first visible GPU (one GPU per rank); a list gives the
            device of each node-local rank; False leaves devices alone (the current one).
        share_device: let several ranks drive one GPU, over NCCL's sockets on loopback (default
            ``DML_NCCL_SHARE_DEVICE``, off). A rehearsal of a multi-rank job on one GPU, for tests;
            it is slower than one GPU per rank. Without it, two ranks on one physical GPU are refused.
        **mpi_options: passed to ``initialize(MPIBackend, ...)`` when it is not yet initialized.

    Raises:
        RuntimeError: on every rank, before NCCL starts: a rank sees no GPU, the build of torch is
            CPU-only, two ranks would drive one GPU (without ``share_device``), or the ranks disagree
            on ``share_device``.
    """

    takes_device_buffers = True
    native_avg = True  # host buffers: the MPI backend sums and divides per segment

    def __init__(
        self,
        *,
        mpi_backend: MPIBackend | None = None,
        cuda_devices: Any = None,
        share_device: bool | None = None,
        **mpi_options: Any,
    ) -> None:
        super().__init__()
        if not (cuda_devices is None or cuda_devices is False or isinstance(cuda_devices, (list, tuple))):
            raise TypeError(f"cuda_devices: got {cuda_devices!r}; allowed: None, a list of device indices, or False")
        share = _share_option(share_device)
        nccl = _import_nccl()
        if mpi_backend is None:
            from distutils_ml.registry import get_distributed_backend, initialize

            initialize(MPIBackend, **mpi_options)
            mpi_backend = get_distributed_backend(MPIBackend)
        self.mpi = mpi_backend
        self._owns_mpi = False  # an MPI backend made for this one (duplicate()): closed with it
        self.debug = mpi_backend.debug
        #: Whether several ranks may drive one GPU (a rehearsal on one GPU).
        self.share_device = share
        #: The CUDA device index of this rank's NCCL communicator: CUDA buffers must be on it.
        self.device = self._place(cuda_devices)
        if share:  # NCCL's duplicate-GPU check compares host ids: a distinct one per rank, talking over loopback
            os.environ["NCCL_HOSTID"] = f"dml-rehearsal-rank-{mpi_backend.rank}"
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_IB_DISABLE", "1")
        uid = nccl.get_unique_id() if mpi_backend.rank == 0 else None
        uid = mpi_backend._bcast_object(uid, 0)
        self.nccl_comm = nccl.NcclCommunicator(mpi_backend.size, uid, mpi_backend.rank)
        self.nccl_version = int(nccl.get_version())
        atexit.register(_destroy, weakref.ref(self))  # runs before mpi4py's MPI_Finalize (registered earlier)

    def _place(self, cuda_devices: Any) -> int:
        """Choose and set this rank's GPU, after every rank has said what it sees (errors on every rank)."""
        mpi = self.mpi
        gpus, problem = _visible_gpus()
        current = torch.cuda.current_device() if problem is None else None
        mine = (gpus, problem, mpi.node_local_rank, self.share_device, current)
        every = [pickle.loads(b) for b in mpi._allgather_bytes(pickle.dumps(mine))]
        hosts = mpi.hosts
        for r, (_, trouble, *_) in enumerate(every):
            if trouble is not None:
                raise RuntimeError(f"NCCLBackend: rank {r} (on {hosts[r]}) {trouble}")
        shares = [e[3] for e in every]
        if len(set(shares)) > 1:
            raise RuntimeError(
                f"NCCLBackend: share_device ({_SHARE_ENV}) differs across ranks: on for ranks "
                f"{[r for r, x in enumerate(shares) if x]}, off for the others; set it the same on every rank"
            )
        if cuda_devices is False:  # each rank's current device
            chosen: list[int | str] = [e[4] for e in every]
        else:
            chosen = choose_devices(cuda_devices, [e[0] for e in every], hosts, [e[2] for e in every])
        for r, c in enumerate(chosen):
            if isinstance(c, str):
                raise ValueError(f"NCCLBackend: rank {r} (on {hosts[r]}): {c}")
        gpu_of = [every[r][0][int(c)] for r, c in enumerate(chosen)]
        clash = None if self.share_device else shared_gpus(gpu_of, hosts)
        if clash is not None:
            raise RuntimeError(f"NCCLBackend: {clash}")
        device = int(chosen[mpi.rank])
        if cuda_devices is not False:
            torch.cuda.set_device(device)
            import cupy

            cupy.cuda.Device(device).use()
        return device

    @property
    def rank(self) -> int:
        return self.mpi.rank

    @property
    def size(self) -> int:
        return self.mpi.size

    # -- host buffers and objects: the MPI backend ---------------------------------------

    def duplicate(self) -> NCCLBackend:
        """A new ``NCCLBackend`` on this rank's GPU, over a new NCCL communicator bootstrapped on a duplicate of
        this one's MPI communicator (a collective on every rank)."""
        with torch.cuda.device(self.device):
            made = NCCLBackend(mpi_backend=self.mpi.duplicate(), cuda_devices=False, share_device=self.share_device)
        made._owns_mpi = True
        return made

    def _release(self) -> None:
        """Destroy the NCCL communicator, then close the MPI backend if this one made it (duplicate())."""
        _destroy(weakref.ref(self))
        if self._owns_mpi:
            self.mpi.close()

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


def _destroy(ref: weakref.ref[NCCLBackend]) -> None:
    """At exit: destroy the NCCL communicator while MPI (which bootstrapped it) is still up."""
    backend = ref()
    comm = None if backend is None else backend.__dict__.pop("nccl_comm", None)
    if comm is not None:
        comm.destroy()
