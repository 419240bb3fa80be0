"""One communication thread per backend: collectives that run while the caller computes.

Gradient buckets are reduced on it during ``backward()`` (blocking collectives: mpi4py
releases the GIL while MPI works, so the autograd engine keeps computing). Jobs run in
the order they were submitted. A collective any other thread starts while jobs are
queued or running first waits for them (:meth:`Backend._enter`), so the messages of
the thread and of the caller leave in the order the caller's program made them, the
same on every rank, and never interleave.

A job runs on the CUDA device that was current where it was submitted: a new thread starts
on device 0, where a rank driving another GPU would otherwise make a CUDA context of its own
and launch work.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from distutils_ml.backends.base import Backend

__all__ = ["CommThread", "comm_thread"]

_LOCK = threading.Lock()


class CommThread:
    """Runs submitted jobs one after another on a daemon thread that holds the backend while it works."""

    def __init__(self, backend: Backend) -> None:
        self._backend = weakref.ref(backend)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], int | None] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"dml-comm-{backend.rank}", daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job`` (no arguments); it runs after every job submitted before it, on this thread's CUDA device."""
        backend = self._backend()
        if backend is None:  # pragma: no cover - the backend owns this thread
            raise RuntimeError("the backend of this communication thread is gone")
        with self._done:
            backend._comm_pending += 1
        self._jobs.put((job, current_cuda_device()))

    def wait(self, *, errors: bool = True) -> None:
        """Return once every submitted job has run; re-raise the first error one of them raised (``errors``)."""
        backend = self._backend()
        with self._done:
            while backend is not None and backend._comm_pending:
                self._done.wait()
            if not errors:
                return
            raised, self._errors = self._errors, []
        if raised:
            raise raised[0]

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, device = item
            backend = self._backend()
            try:
                if backend is None:
                    return
                with backend._entry:  # blocking: a caller's collective in flight finishes first
                    backend._comm_holds = True
                    try:
                        if device is None:
                            job()
                        else:
                            with torch.cuda.device(device):
                                job()
                    finally:
                        backend._comm_holds = False
            except BaseException as e:
                with self._done:
                    self._errors.append(e)
            finally:
                if backend is not None:
                    with self._done:
                        backend._comm_pending -= 1
                        self._done.notify_all()
                del backend

    def close(self) -> None:
        """Stop the thread after the jobs already queued."""
        self._jobs.put(None)


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, or None where CUDA was never initialized in this process."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def comm_thread(backend: Backend) -> CommThread:
    """The backend's communication thread (started at the first call)."""
    worker = backend._comm
    if worker is None:
        with _LOCK:
            worker = backend._comm
            if worker is None:
                worker = backend._comm = CommThread(backend)
    return worker
