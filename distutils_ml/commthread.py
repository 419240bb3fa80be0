"""One communication thread per backend: collectives that run while the caller computes.

Gradient buckets are reduced on it during ``backward()`` (blocking collectives: mpi4py
releases the GIL while MPI works, so the autograd engine keeps computing). Jobs run in
the order they were submitted. A collective any other thread starts while jobs are
queued or running first waits for them (``Backend._enter``), so the messages of
the thread and of the caller leave in the order the caller's program made them, the
same on every rank, and never interleave.

The thread is the backend's (:meth:`Backend.comm_thread`); it holds the backend's entry
lock, handed to it at construction, while a job runs, and keeps the count of queued jobs
and whether it holds the lock, which the backend reads.

A job runs on the CUDA device that was current where it was submitted: a new thread starts
on device 0, where a rank driving another GPU would otherwise make a CUDA context of its own
and launch work.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CommThread", "current_cuda_device"]


class CommThread:
    """Runs submitted jobs one after another on a daemon thread that holds ``entry`` while it works.

    Args:
        entry: the backend's lock, held by whoever is inside one of its collectives.
        name: the thread's name.
    """

    def __init__(self, entry: Any, name: str) -> None:
        self._entry = entry
        #: Jobs submitted and not finished yet.
        self.pending = 0
        #: Whether this thread holds ``entry`` now (a job is running).
        self.holds = False
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], int | None] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        #: The thread's identifier (``threading.get_ident()`` on it).
        self.ident = self._thread.ident

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job`` (no arguments); it runs after every job submitted before it, on this thread's CUDA device."""
        with self._done:
            self.pending += 1
        self._jobs.put((job, current_cuda_device()))

    def wait(self, *, errors: bool = True) -> None:
        """Return once every submitted job has run; re-raise the first error one of them raised (``errors``)."""
        with self._done:
            while self.pending:
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
            try:
                with self._entry:  # blocking: a caller's collective in flight finishes first
                    self.holds = True
                    try:
                        if device is None:
                            job()
                        else:
                            with sys.modules["torch"].cuda.device(device):
                                job()
                    finally:
                        self.holds = False
            except BaseException as e:
                with self._done:
                    self._errors.append(e)
            finally:
                with self._done:
                    self.pending -= 1
                    self._done.notify_all()

    def close(self) -> None:
        """Stop the thread after the jobs already queued, and wait for it to end (unless called on it)."""
        self._jobs.put(None)
        if threading.get_ident() != self.ident:
            self._thread.join()


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, or None where torch's CUDA was never initialized in this process."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
