"""Array handling shared by every backend: buffer kinds, dtypes, contiguity, views.

A user's buffer (NumPy array or CPU ``torch.Tensor``) is turned into a NumPy array
that shares its memory, so backends only ever see NumPy. bfloat16 has no NumPy
dtype: its bits travel as int16, and reductions go through a float32 working copy.

A contiguous CPU tensor's view is made once per (address, shape, dtype) and then reused:
``Tensor.numpy()`` builds a new array on every call (about 0.7 µs, a third of what a 4 KiB
allreduce costs over raw mpi4py), a lookup reads six tensor attributes (``_VIEWS``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import ReduceOp

__all__ = [
    "ArrayLike",
    "HALF_DTYPES",
    "OnDevice",
    "OP_DTYPE_OK",
    "TORCH_DTYPE",
    "FLOAT_DTYPES",
    "check_op_dtype",
    "cuda_tensor",
    "dtype_name",
    "not_contiguous",
    "array_subclass",
    "pinned_like",
    "torch_dtype_name",
    "unusual_tensor",
    "result_view",
    "source_view",
    "to_float32",
    "write_back",
]

#: A buffer the collectives accept.
ArrayLike = np.ndarray | torch.Tensor

_NP_DTYPES = {
    np.dtype(name): name
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
_TORCH_DTYPES = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
#: The torch dtype of each portable dtype name.
TORCH_DTYPE = {name: dtype for dtype, name in _TORCH_DTYPES.items()}
_ALLOWED_DTYPES = (
    "bool, int8, int16, int32, int64, uint8 (and uint16/32/64 for NumPy), float16, bfloat16 (torch), float32, float64"
)

HALF_DTYPES = frozenset({"float16", "bfloat16"})
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_INT_DTYPES = frozenset(n for n in _NP_DTYPES.values() if n.startswith(("int", "uint")))

# (op, dtype) pairs a reduction accepts; anything else is a TypeError.
OP_DTYPE_OK = frozenset(
    [(op, dt) for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN) for dt in FLOAT_DTYPES | _INT_DTYPES]
    + [(ReduceOp.AVG, dt) for dt in FLOAT_DTYPES]
    + [(ReduceOp.MAX, "bool"), (ReduceOp.MIN, "bool")]
)


def dtype_name(buf: ArrayLike) -> str:
    """The portable dtype name (``"float32"``, ``"bfloat16"``...) of a NumPy array or tensor.

    Raises:
        TypeError: an unsupported dtype.
    """
    table: dict[Any, str] = _TORCH_DTYPES if isinstance(buf, torch.Tensor) else _NP_DTYPES  # type: ignore[assignment]
    name = table.get(buf.dtype)
    if name is None:
        raise TypeError(f"dtype {buf.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    return name


def check_op_dtype(op: ReduceOp, dt: str, name: str) -> None:
    """Raise ``TypeError`` when reduction ``op`` is not defined for dtype ``dt``."""
    if (op, dt) in OP_DTYPE_OK:
        return
    if op is ReduceOp.AVG:
        raise TypeError(
            f"{name}: dml.AVG needs a floating-point buffer, got dtype {dt}; "
            "use dml.SUM and divide yourself, or convert the buffer to a float dtype"
        )
    raise TypeError(f"{name}: {op!r} is not defined for dtype {dt}; bool buffers allow only dml.MAX and dml.MIN")


class OnDevice(Exception):
    """Raised by the host views for a CUDA buffer: the collectives then take the device path."""


def _type_error(buf: Any, name: str) -> Exception:
    if isinstance(buf, torch.Tensor):
        if buf.is_cuda:
            return OnDevice()
        return TypeError(f"{name}: a torch tensor on device '{buf.device}' is not supported; pass a CPU or CUDA tensor")
    if hasattr(type(buf), "__cuda_array_interface__"):  # CuPy and other CUDA arrays
        return OnDevice()
    return TypeError(
        f"{name}: got {type(buf).__module__}.{type(buf).__qualname__}; "
        "allowed: numpy.ndarray, torch.Tensor (CPU or CUDA) or a CuPy array"
    )


def unusual_tensor(buf: torch.Tensor, name: str, in_place: bool) -> Exception | None:
    """An error for a tensor that is not a plain dense one (sparse, nested, quantized, or, where
    ``in_place``, a lazy negation/conjugate view), or None."""
    if buf.is_quantized:
        return TypeError(
            f"{name}: a quantized tensor is not supported; allowed: dense (strided) tensors of a plain dtype. "
            "Convert it with .dequantize()"
        )
    if buf.is_nested:
        return TypeError(
            f"{name}: a nested tensor is not supported; allowed: dense (strided) tensors. Send its components "
            "one by one, or pad them into one dense tensor (torch.nested.to_padded_tensor)"
        )
    if buf.layout is not torch.strided:
        layout = str(buf.layout).removeprefix("torch.")
        return TypeError(
            f"{name}: a {layout} tensor is not supported; allowed: dense (strided) tensors. "
            "Convert it with .to_dense() (and back with .to_sparse() after the collective)"
        )
    if in_place and (buf.is_neg() or buf.is_conj()):
        bit = "negative" if buf.is_neg() else "conjugate"
        return ValueError(
            f"{name}: the tensor has its {bit} bit set (a lazy view, e.g. from torch._neg_view or .conj()) and "
            f"cannot receive a result in place; pass a materialized tensor (.resolve_{bit[:3]}()) and copy back"
        )
    return None


def cuda_tensor(buf: Any, name: str) -> torch.Tensor:
    """A torch CUDA tensor sharing ``buf``'s memory (a CUDA tensor itself, or a CuPy array via DLPack).

    Raises:
        TypeError: not a CUDA buffer, or an unsupported dtype.
    """
    if isinstance(buf, torch.Tensor):
        t = buf.detach()
    elif hasattr(type(buf), "__cuda_array_interface__"):
        t = torch.from_dlpack(buf)  # zero-copy; ordered after CuPy's current stream
    else:
        raise TypeError(f"{name}: got {type(buf).__qualname__}; allowed: a CUDA torch.Tensor or a CuPy array")
    unusual = unusual_tensor(t, name, in_place=False)
    if unusual is not None:
        raise unusual
    if not t.is_cuda:
        raise TypeError(f"{name}: a tensor on device '{t.device}' where a CUDA buffer was expected")
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    return t


def torch_dtype_name(t: torch.Tensor) -> str:
    """The portable dtype name of a tensor whose dtype is supported."""
    return _TORCH_DTYPES[t.dtype]


def pinned_like(owner: Any, slot: str, t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor shaped like ``t``, reused across calls (one growing buffer per ``owner`` and ``slot``)."""
    cache: dict[str, torch.Tensor] = owner.__dict__.setdefault("_pinned_buffers", {})
    nbytes = t.numel() * t.element_size()
    buf = cache.get(slot)
    if buf is None or buf.numel() < nbytes:
        buf = cache[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes].view(t.dtype).view(t.shape)


# NumPy dtypes of the torch dtypes above (bfloat16 has none), for the fast path of _torch_view.
_TORCH_AS_NP = {np.dtype(n): n for n in _TORCH_DTYPES.values() if n != "bfloat16"}

#: Views of contiguous CPU tensors by (data_ptr, shape, dtype), with their dtype names. A view
#: describes memory without owning it or holding its tensor (so the cache keeps no tensor alive),
#: and is handed out only to a CPU tensor without a negative bit that is contiguous and has that
#: address, shape and dtype now (:func:`_torch_view`): for the duration of a collective, whose
#: caller holds the tensor, it is that tensor's memory. An entry whose tensor is gone is never
#: read, only matched again by a tensor at the same address, shape and dtype.
_VIEWS: dict[tuple[int, Any, torch.dtype], tuple[np.ndarray, str]] = {}
_VIEWS_MAX = 4096  # entries, under 1 KiB each


class _Memory:
    """``__array_interface__`` of a block of memory, for a NumPy view that holds no reference to its owner."""

    __slots__ = ("__array_interface__",)

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}


def _remember(buf: torch.Tensor, arr: np.ndarray, dt: str) -> tuple[np.ndarray, str]:
    """Return ``(arr, dt)`` (``arr``: a view of ``buf`` that holds it), and cache a view of ``buf``
    that holds nothing when ``buf`` is one that :func:`_torch_view` may hand out."""
    ptr = buf.data_ptr()
    if arr.size and ptr and buf.is_cpu and not buf.is_neg() and buf.is_contiguous():
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()  # one step, safe against other threads; the views in use are made again
        view = np.asarray(_Memory(ptr, arr.shape, arr.dtype.str))
        _VIEWS[(ptr, buf.shape, buf.dtype)] = (view, dt)
    return arr, dt


def _torch_view(buf: torch.Tensor, name: str, contiguous: bool) -> tuple[np.ndarray, str]:
    # The per-call cost of every collective on a tensor: a cached view when this tensor's memory
    # had one (six attribute reads), else one numpy() call, which itself refuses what needs care
    # below (bfloat16, requires_grad, non-CPU devices).
    try:
        hit = _VIEWS.get((buf.data_ptr(), buf.shape, buf.dtype))
    except Exception:  # no data pointer or sizes (sparse, nested, fake tensors): named below
        hit = None
    if hit is not None and buf.is_cpu and not buf.is_neg() and buf.is_contiguous():
        return hit
    try:
        arr = buf.numpy()
    except (TypeError, RuntimeError):
        return _torch_view_checked(buf, name, contiguous)
    dt = _TORCH_AS_NP.get(arr.dtype)
    if dt is None:
        raise TypeError(f"{name}: dtype {buf.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    if contiguous and not arr.flags.c_contiguous:
        raise not_contiguous(name, buf.shape)
    return _remember(buf, arr, dt)


def _torch_view_checked(buf: torch.Tensor, name: str, contiguous: bool) -> tuple[np.ndarray, str]:
    unusual = unusual_tensor(buf, name, in_place=contiguous)
    if unusual is not None:
        raise unusual
    if not buf.is_cpu:
        raise _type_error(buf, name)
    dt = _TORCH_DTYPES.get(buf.dtype)
    if dt is None:
        raise TypeError(f"{name}: dtype {buf.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    if contiguous and not buf.is_contiguous():
        raise not_contiguous(name, buf.shape)
    view = buf.detach() if buf.requires_grad else buf
    if buf.is_neg() or buf.is_conj():  # a lazy view read as a source: materialize it (a copy: not cached)
        view = view.resolve_neg().resolve_conj()
    if dt == "bfloat16":
        view = view.view(torch.int16)
    return _remember(buf, view.numpy(), dt)


def not_contiguous(name: str, shape: Any) -> ValueError:
    return ValueError(
        f"{name}: a non-contiguous buffer of shape {tuple(shape)} cannot receive a result in place; "
        "pass a contiguous buffer (tensor.contiguous() / numpy.ascontiguousarray) and copy back"
    )


def array_subclass(buf: np.ndarray, name: str) -> TypeError | None:
    """An error for a subclass of ``numpy.ndarray`` other than ``np.memmap`` (plain data), or None: a masked
    array's mask would be dropped or mixed, and ``np.matrix`` keeps two axes where a row is indexed."""
    if type(buf) in (np.ndarray, np.memmap):
        return None
    return TypeError(
        f"{name}: got a {type(buf).__module__}.{type(buf).__qualname__}, a subclass of numpy.ndarray whose own "
        "rules (a mask, matrix indexing) a collective cannot keep; allowed: plain NumPy arrays and CPU tensors. "
        "Pass np.asarray(buf) (for a masked array, its data and np.ma.getmaskarray(buf) apart)"
    )


def result_view(buf: Any, name: str) -> tuple[np.ndarray, str]:
    """A writable, C-contiguous NumPy view of a buffer that receives a result, and its dtype name.

    Raises:
        TypeError: not a NumPy array or CPU tensor (a subclass of ndarray but ``np.memmap`` included), or an
            unsupported dtype.
        ValueError: not C-contiguous, or read-only.
    """
    if isinstance(buf, np.ndarray):
        subclass = array_subclass(buf, name)
        if subclass is not None:
            raise subclass
        dt = _NP_DTYPES.get(buf.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {buf.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
        flags = buf.flags
        if not flags.c_contiguous:
            raise not_contiguous(name, buf.shape)
        if not flags.writeable:
            raise ValueError(f"{name}: the array is read-only and cannot receive a result; pass a writable array")
        return buf, dt
    if isinstance(buf, torch.Tensor):
        return _torch_view(buf, name, True)
    raise _type_error(buf, name)


def source_view(buf: Any, name: str, recv: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """A C-contiguous NumPy array with ``buf``'s data (a view where possible, else a copy), and its dtype name.

    Raises:
        ValueError: ``buf``'s memory overlaps ``recv``'s (the result buffer of the same call), told apart before a
            non-contiguous ``buf`` is copied.
    """
    if isinstance(buf, np.ndarray):
        subclass = array_subclass(buf, name)
        if subclass is not None:
            raise subclass
        dt = _NP_DTYPES.get(buf.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {buf.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    elif isinstance(buf, torch.Tensor):
        buf, dt = _torch_view(buf, name, False)
    else:
        raise _type_error(buf, name)
    if recv is not None and np.may_share_memory(buf, recv) and _shares_memory(buf, recv):
        raise _overlap_error()
    if not buf.flags.c_contiguous:
        buf = np.ascontiguousarray(buf)
    return buf, dt


def _shares_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` share an element (strided views whose bounds overlap may not), counted as sharing
    where the exact answer would take long (interleaved strides)."""
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:
        return True


def _overlap_error() -> ValueError:
    return ValueError("sendbuf and recvbuf overlap; pass the same buffer once for the in-place form")


def to_float32(buf: Any, arr: np.ndarray) -> np.ndarray:
    """A float32 working copy of a float16/bfloat16 buffer (``arr`` is its view)."""
    if isinstance(buf, torch.Tensor):
        return buf.detach().to(torch.float32).contiguous().numpy()
    return arr.astype(np.float32)


def write_back(buf: Any, arr: np.ndarray, work: np.ndarray) -> None:
    """Round the float32 ``work`` into the half-precision result buffer (``arr`` is its view)."""
    if isinstance(buf, torch.Tensor):
        buf.detach().copy_(torch.from_numpy(work))
    else:
        np.copyto(arr, work, casting="unsafe")
