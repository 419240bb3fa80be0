"""One flat broadcast per (dtype, device type): root's arrays into every rank's arrays.

Used by ``synchronize`` and ``broadcast_buffers``: many leaves (a model's parameters and
buffers) travel in few large broadcasts instead of one per leaf.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from distutils_ml.arrays import TORCH_DTYPE, OnDevice, cuda_tensor, result_view
from distutils_ml.backends.base import Backend
from distutils_ml.collectives import bcast
from distutils_ml.tree import Spec

__all__ = ["FusedBroadcast"]


class FusedBroadcast:
    """Root's arrays into every rank's arrays: one flat 1-D broadcast per (dtype, device type).

    Built before the ranks agree, from the agreed ``specs`` (root's shapes, dtypes and
    device types) alone: every rank calls the same collectives with the same shapes,
    whatever its arrays' layout. Construction does everything that can fail locally
    (checks, staging buffers, root's copy into them); :meth:`run` then only broadcasts
    and, off root, copies staged data back into the arrays.

    A group of one contiguous leaf that the collectives accept as it is travels in place
    (a 1-D view of it); any other leaf (negative or other strides, read-only on root,
    a view torch will not hand to NumPy) is copied into a flat buffer and back.
    """

    def __init__(self, leaves: list[Any], paths: list[str], specs: list[Spec], is_root: bool) -> None:
        self.is_root = is_root
        members: dict[tuple[str, str], list[tuple[Any, tuple[int, ...]]]] = {}
        for leaf, path, (shape, dtype, device) in zip(leaves, paths, specs, strict=True):
            if not is_root:
                _check_writable(leaf, path)
            members.setdefault((dtype, device), []).append((leaf, shape))
        # (buffer, [(leaf, segment)]): the buffer each broadcast sends, and where each leaf's data sits in it
        self.groups: list[tuple[Any, list[tuple[Any, Any]]]] = []
        for (dtype, _), group in members.items():
            total = sum(math.prod(shape) for _, shape in group)
            if total == 0:
                continue
            direct = _in_place_buffer(group[0][0]) if len(group) == 1 else None
            if direct is not None:
                self.groups.append((direct, []))
                continue
            flat = _flat_buffer(total, dtype, group[0][0])
            segments, offset = [], 0
            for leaf, shape in group:
                n = math.prod(shape)
                segment = _segment(flat[offset : offset + n].reshape(shape), leaf)
                if is_root:
                    _copy(segment, leaf)
                segments.append((leaf, segment))
                offset += n
            self.groups.append((flat, segments))

    def run(self, backend: Backend, root: int) -> None:
        """Broadcast every group from root; off root, copy staged data into the leaves."""
        for buf, segments in self.groups:
            bcast(backend, buf, root=root)
            if not self.is_root:
                for leaf, segment in segments:
                    _copy(leaf, segment)


def _in_place_buffer(leaf: Any) -> Any:
    """A flat 1-D view of ``leaf`` that ``bcast`` accepts as it is, or None (then it is staged)."""
    if isinstance(leaf, np.ndarray):
        if not (leaf.flags.c_contiguous and leaf.flags.writeable):
            return None
        return np.asarray(leaf).reshape(-1)  # a subclass's data (a masked array's, its mask left as it is)
    view = leaf.detach()
    if not view.is_contiguous():
        return None
    view = view.view(-1)
    try:
        result_view(view, "buf")
    except OnDevice:
        if not cuda_tensor(view, "buf").is_contiguous():
            return None
    except Exception:
        return None
    return view


def _flat_buffer(total: int, dtype: str, first: Any) -> Any:
    """A staging buffer: NumPy for CPU dtypes NumPy has, else a torch tensor on ``first``'s device."""
    if isinstance(first, np.ndarray) or (first.device.type == "cpu" and dtype != "bfloat16"):
        return np.empty(total, dtype=np.dtype(dtype))
    return torch.empty(total, dtype=TORCH_DTYPE[dtype], device=first.device)


def _segment(part: Any, leaf: Any) -> Any:
    """``leaf``'s part of the staging buffer, of ``leaf``'s kind (array or tensor)."""
    if isinstance(leaf, torch.Tensor) and isinstance(part, np.ndarray):
        return torch.from_numpy(part)  # our own contiguous buffer: always accepted
    return part


def _copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for same-kind arrays of one shape, whatever their strides."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.detach().copy_(src.detach())


def _check_writable(leaf: torch.Tensor | np.ndarray, path: str) -> None:
    """Raise unless root's data can be written into ``leaf`` in place."""
    if isinstance(leaf, np.ndarray):
        if not leaf.flags.writeable:
            raise ValueError(f"{path}: a read-only array cannot receive root's data; pass a writable array")
    elif leaf.numel() > 1 and any(s == 0 and n > 1 for s, n in zip(leaf.stride(), leaf.shape, strict=True)):
        raise ValueError(
            f"{path}: elements of this tensor share memory (an expanded view) and cannot each receive root's "
            "data; pass a tensor with memory of its own (.clone())"
        )
