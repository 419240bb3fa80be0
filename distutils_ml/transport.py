"""Which transport carries the gradient buckets: the backend's collectives, or a gloo group across hosts.

``DML_TRANSPORT`` chooses: ``auto`` (default: gloo when the ranks span several hosts, the backend on one host,
where MPI's shared memory is faster), ``gloo`` (always gloo; an error on every rank if it cannot connect) or
``mpi`` (never). ``tcp``, the name of the library's former TCP ring, is a deprecated alias of ``gloo``.

Why not MPI across hosts: Open MPI progresses its TCP transport only while a thread polls it, so a
communication thread waiting in ``MPI_Allreduce`` spins on the core backward computes on, and while backward
holds that core the sockets are not drained (measured on a 1 Gbit/s, 1 ms link: a 64 MiB allreduce took 0.58 s
alone and 0.94-1.24 s beside a 0.15 s matmul). gloo's threads sleep until bytes arrive
(docs/benchmarks/network.md). The group is made once per backend (:func:`transport_for`, a collective), from a
store rank 0 opens on the interface ``DML_SOCKET_IFNAME`` names (:mod:`distutils_ml.gloo`).
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

from distutils_ml.backends.base import Backend
from distutils_ml.gloo import GlooTransport, connect_gloo

__all__ = ["IFNAME_ENV", "TRANSPORT_ENV", "transport_choice", "transport_for"]

TRANSPORT_ENV = "DML_TRANSPORT"
IFNAME_ENV = "DML_SOCKET_IFNAME"
_CHOICES = ("auto", "gloo", "mpi")
_ALIASES = {"tcp": "gloo"}
_warned: set[str] = set()


def transport_choice() -> str:
    """``DML_TRANSPORT`` (``auto``, ``gloo`` or ``mpi``; default ``auto``; ``tcp`` is a deprecated alias of
    ``gloo``, with a warning), else ``ValueError``."""
    text = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if text in _ALIASES:
        if text not in _warned:
            _warned.add(text)
            warnings.warn(
                f"{TRANSPORT_ENV}={text} is deprecated: the library's TCP ring was replaced by a gloo group; "
                f"it means {TRANSPORT_ENV}={_ALIASES[text]} (set that instead)",
                DeprecationWarning,
                stacklevel=2,
            )
        return _ALIASES[text]
    if text not in _CHOICES:
        raise ValueError(f"{TRANSPORT_ENV}={text!r}; allowed: auto, gloo, mpi (tcp: a deprecated alias of gloo)")
    return text


# The transport of each backend (None: its own collectives), made once.
_TRANSPORTS: weakref.WeakKeyDictionary[Backend, GlooTransport | None] = weakref.WeakKeyDictionary()


def transport_for(backend: Backend) -> GlooTransport | None:
    """The backend's transport for gradient buckets (made at the first call, a collective on every rank), or None
    to use the backend's own collectives.

    None on a backend that is not MPI's, in a world of one rank, when ``DML_TRANSPORT`` is ``mpi``, and under
    ``auto`` when every rank runs on one host. Under ``auto`` a group that cannot connect is a warning on every
    rank (once) and None (the buckets go over MPI, and overlap is off by default); under ``gloo`` it is a
    ``RuntimeError`` on every rank.
    """
    if backend in _TRANSPORTS:
        return _TRANSPORTS[backend]
    if backend.closed:
        raise RuntimeError(f"{backend!r} is closed: it has no transport")
    transport = _TRANSPORTS[backend] = _connect(backend)
    backend.on_close(functools.partial(_forget, weakref.ref(backend)))
    return transport


def _forget(ref: weakref.ref[Backend]) -> None:
    """At :meth:`Backend.close`: close the backend's transport."""
    backend = ref()
    transport = None if backend is None else _TRANSPORTS.pop(backend, None)
    if transport is not None:
        transport.close()


def _connect(backend: Backend) -> GlooTransport | None:
    from distutils_ml.objects import allgather_object

    hosts = getattr(backend, "hosts", None)
    if hosts is None or backend.size == 1 or not hasattr(backend, "comm"):
        return None
    choices = allgather_object(backend, _choice_or_error())
    errors = [c for c in choices if c not in _CHOICES]
    if errors:
        raise ValueError(errors[0])
    if len(set(choices)) > 1:
        by = "; ".join(
            f"{c!r} on rank(s) {[r for r, x in enumerate(choices) if x == c]}" for c in dict.fromkeys(choices)
        )
        raise ValueError(f"{TRANSPORT_ENV} differs across ranks ({by}); set it to the same value on every rank")
    choice = choices[0]
    if choice == "mpi" or (choice == "auto" and len(set(hosts)) == 1):
        return None
    transport, why = connect_gloo(backend, hosts, IFNAME_ENV)
    if transport is not None:
        return transport
    if choice == "gloo":
        raise RuntimeError(
            f"{TRANSPORT_ENV}=gloo: the ranks could not make their gloo group ({why}). Choose the interface with "
            f"{IFNAME_ENV}, open the ports between the hosts, or use {TRANSPORT_ENV}=mpi"
        )
    warnings.warn(
        f"the gradient buckets go over MPI, with overlap off by default: the gloo group across hosts could not "
        f"connect ({why}); set {IFNAME_ENV}, or {TRANSPORT_ENV}=mpi to choose MPI without trying",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _choice_or_error() -> str:
    try:
        return transport_choice()
    except ValueError as e:
        return str(e)
