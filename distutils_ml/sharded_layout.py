"""The flat-buffer layout of ``ShardedOptimizer``: flat buffers, the buckets cut from them, this rank's pieces.

The parameters that require gradients move into one flat buffer per (dtype, device): each
parameter's ``.data`` becomes a view of it, and its ``.grad`` a view of a flat gradient buffer
laid out alike. Each flat buffer holds its buckets one after the other, each padded to a
multiple of W, the number of ranks; rank r owns piece r of every bucket (its shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ALIGN_BYTES", "Bucket", "Flat", "Layout", "Piece", "build_layout"]

# Each parameter starts on a 64-byte boundary of its flat buffer, as torch's allocator places tensors: CPU
# kernels (BLAS) may round differently on data at other offsets.
ALIGN_BYTES = 64


@dataclass
class Flat:
    """The flat parameter and gradient buffers of one (dtype, device)."""

    values: torch.Tensor
    grads: torch.Tensor
    shard: int = 0  # elements of it this rank owns (the same on every rank)


@dataclass
class Bucket:
    """A contiguous range of one flat buffer, reduce-scattered and allgathered in one collective each."""

    flat: Flat
    params: list[int]  # in the order of their elements
    start: int
    piece: int  # elements per rank: the bucket is size * piece long (with padding at its end)
    values: torch.Tensor  # (size, piece) view of the flat parameters
    grads: torch.Tensor  # (size, piece) view of the flat gradients
    shard_at: int  # where this rank's piece starts in its shard of the flat buffer


@dataclass
class Piece:
    """This rank's part of one parameter: elements ``lo:hi`` of ``p.reshape(-1)``."""

    index: int
    tensor: torch.Tensor  # what the shard optimizer steps: shaped like the parameter if whole, else 1-D
    grad: torch.Tensor | None  # the matching view of the flat gradients (None: a parameter outside the buffers)
    lo: int
    hi: int
    whole: bool
    shard_at: int = -1  # where it starts in this rank's shard of its flat buffer


class Layout(NamedTuple):
    """Where every parameter lives in the flat buffers, and what this rank steps."""

    offset: list[int]  # each parameter's first element in its flat buffer (-1: outside the buffers)
    flats: list[Flat]
    buckets: list[Bucket]
    bucket_of: list[int]  # each parameter's bucket (-1: none, a parameter without elements)
    views: list[torch.Tensor | None]  # each parameter's view of the flat gradients
    values: list[torch.Tensor | None]  # each parameter's view of the flat parameters (its .data)
    pieces: list[Piece]  # this rank's parts of the parameters, in bucket order


def build_layout(
    params: list[torch.Tensor], groups: list[tuple[tuple[torch.dtype, torch.device], list[int]]], size: int, rank: int
) -> Layout:
    """Flat buffers for ``params`` holding buckets ``groups`` (parameter indices per bucket, in the order buckets are
    sent), their values and gradients copied in and the parameters made views of them; rank ``rank``'s pieces."""
    starts: dict[tuple[torch.dtype, torch.device], int] = {}
    placed: list[tuple[tuple[torch.dtype, torch.device], list[int], int, int]] = []
    offset = [-1] * len(params)
    for key, members in groups:
        start = starts.get(key, 0)
        at = start
        align = max(1, ALIGN_BYTES // key[0].itemsize)
        for i in members:
            offset[i] = at = -(-at // align) * align
            at += params[i].numel()
        piece = -(-(at - start) // size)
        placed.append((key, members, start, piece))
        starts[key] = start + piece * size
    flats = {
        key: Flat(torch.zeros(total, dtype=key[0], device=key[1]), torch.zeros(total, dtype=key[0], device=key[1]))
        for key, total in starts.items()
    }
    buckets: list[Bucket] = []
    bucket_of = [-1] * len(params)
    for key, members, start, piece in placed:
        flat = flats[key]
        region = slice(start, start + piece * size)
        buckets.append(
            Bucket(
                flat,
                members,
                start,
                piece,
                flat.values[region].view(size, piece),
                flat.grads[region].view(size, piece),
                flat.shard,
            )
        )
        flat.shard += piece
        for i in members:
            bucket_of[i] = len(buckets) - 1
    views: list[torch.Tensor | None] = [None] * len(params)
    values: list[torch.Tensor | None] = [None] * len(params)
    with torch.no_grad():
        for i, p in enumerate(params):
            if bucket_of[i] < 0:
                continue
            flat = buckets[bucket_of[i]].flat
            span = slice(offset[i], offset[i] + p.numel())
            flat.values[span].copy_(p.detach().reshape(-1))
            grad = flat.grads[span].view_as(p)
            if p.grad is not None:
                grad.copy_(p.grad.to_dense() if p.grad.layout != torch.strided else p.grad)
                p.grad = grad
            p.data = values[i] = flat.values[span].view_as(p)
            views[i] = grad
    pieces: list[Piece] = []
    for b in buckets:
        own = b.start + rank * b.piece
        for i in b.params:
            n = params[i].numel()
            lo, hi = max(offset[i], own) - offset[i], min(offset[i] + n, own + b.piece) - offset[i]
            if hi <= lo:
                continue
            whole = lo == 0 and hi == n
            span = slice(offset[i] + lo, offset[i] + hi)
            tensor, grad = b.flat.values[span], b.flat.grads[span]
            if whole:
                tensor, grad = tensor.view_as(params[i]), grad.view_as(params[i])
            pieces.append(Piece(i, tensor, grad, lo, hi, whole, b.shard_at + offset[i] + lo - own))
    if rank == 0:  # parameters without elements: rank 0 steps them as they are
        pieces += [Piece(i, params[i], None, 0, 0, True) for i in range(len(params)) if bucket_of[i] < 0]
    return Layout(offset, list(flats.values()), buckets, bucket_of, views, values, pieces)
