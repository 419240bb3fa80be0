"""How gradient buckets travel: the transport defaults both optimizer forms and the reducer use."""

from __future__ import annotations

import os

from distutils_ml.backends.base import Backend
from distutils_ml.reducer import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from distutils_ml.tcpring import transport_choice

__all__ = ["NETWORK_BUCKET_BYTES", "default_bucket_bytes", "default_overlap", "spans_hosts"]


def default_overlap(backend: Backend) -> bool:
    """Whether buckets go on the communication thread by default: ``DML_OVERLAP`` (1/0) if set, else on
    NCCLBackend, and on MPIBackend when its buckets go over the TCP ring (ranks on several hosts).

    A thread waiting in an MPI collective polls (Open MPI progresses by spinning), so on one
    host's CPUs it takes the core backward computes on. NCCL reduces on the GPU, and across
    hosts the buckets go over :mod:`distutils_ml.tcpring`, whose thread sleeps in ``poll()``
    until bytes arrive (docs/benchmarks/network.md).
    """
    forced = os.environ.get("DML_OVERLAP", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    from distutils_ml.backends.nccl import NCCLBackend

    if isinstance(backend, NCCLBackend):
        return True
    choice = transport_choice()
    return choice == "tcp" or (choice == "auto" and spans_hosts(backend))


def spans_hosts(backend: Backend) -> bool:
    """Whether the backend's ranks run on several hosts (MPI and NCCL backends know; LocalBackend: no)."""
    hosts = getattr(backend, "hosts", None)
    if hosts is None:
        inner = getattr(backend, "mpi", None)
        hosts = getattr(inner, "hosts", None)
    return bool(hosts) and len(set(hosts)) > 1


def default_bucket_bytes(backend: Backend, bucket_bytes: int | None) -> int:
    """``bucket_bytes``, or its default: 256 KiB on one host, 4 MiB across hosts.

    Every bucket costs a network round trip: across hosts, gradients under 4 MiB share
    buckets of about 4 MiB (fewer, larger messages, as DDP's 25 MiB buckets); on one host
    256 KiB measured best (larger gradients reduced in place, never copied).
    """
    if bucket_bytes is not None:
        return check_bucket_bytes(bucket_bytes)
    return NETWORK_BUCKET_BYTES if spans_hosts(backend) else DEFAULT_BUCKET_BYTES


NETWORK_BUCKET_BYTES = 4 << 20
