"""What a rank that has joined (``dml.join``) sends in an allgather made in a block: zeros, or the announcer's buffer.

By default a joined rank answers an allgather with the announcing rank's own buffer, so that the agreement checks
built on allgathers pass as if it said the same. Where an allgather carries data (SyncBatchNorm's per-rank counts
and moments, sparse gradients' entries), the caller asks for zeros with :func:`joined_ranks_send_zeros`: the
joined rank then contributes nothing. Kept apart from :mod:`distutils_ml.uneven` so that the collectives that ask
for zeros need not import the training layer.
"""

from __future__ import annotations

import contextlib
import threading

from distutils_ml.watchdog import thread_setting

__all__ = ["joined_ranks_send_zeros", "world_average", "world_average_requested", "zeros_requested"]

_LOCAL = threading.local()


def joined_ranks_send_zeros() -> contextlib.AbstractContextManager[None]:
    """Inside ``dml.join``: in the allgathers made in this block, ranks that have joined send zeros (data, such as
    SyncBatchNorm's per-rank counts and moments) rather than the announcing rank's buffer (their default, which
    makes agreement checks pass as if they said the same)."""
    return thread_setting(_LOCAL, "zeros", True)


def zeros_requested() -> bool:
    """Whether this thread is inside :func:`joined_ranks_send_zeros`."""
    return bool(getattr(_LOCAL, "zeros", False))


def world_average() -> contextlib.AbstractContextManager[None]:
    """Inside ``dml.join``: ``dml.AVG`` in this block divides by the world size, as outside it, for a caller that
    rescales the result itself (the gradient reducer: :meth:`DistributedOptimizer.average_over`). Elsewhere in
    the block an average is over the ranks that have data."""
    return thread_setting(_LOCAL, "world", True)


def world_average_requested() -> bool:
    """Whether this thread is inside :func:`world_average`."""
    return bool(getattr(_LOCAL, "world", False))
