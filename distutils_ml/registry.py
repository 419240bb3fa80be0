"""Process-wide setup: ``initialize``, ``initialized``, ``get_distributed_backend``.

Backends are types. ``initialize(T, **options)`` creates the process's one instance of
``T``; ``get_distributed_backend(T)`` returns it. Inside ``LocalBackend.spawn``, a
simulated rank's thread sees its own ``LocalBackend``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, TypeVar

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.backends.local import LocalBackend, current_spawned_backend

__all__ = ["initialize", "initialized", "get_distributed_backend", "local_rank", "total_workers"]

B = TypeVar("B", bound=Backend)

_instances: dict[type[Backend], Backend] = {}
_options: dict[type[Backend], dict[str, Any]] = {}  # the options the instance was built with
_lock = threading.RLock()  # re-entrant: NCCLBackend's constructor initializes MPIBackend


def _check_type(backend_type: Any, caller: str) -> None:
    if isinstance(backend_type, Backend):
        name = type(backend_type).__name__
        raise TypeError(f"{caller}: got an instance {backend_type!r}; pass the class instead: {caller}(dml.{name})")
    if not (isinstance(backend_type, type) and issubclass(backend_type, Backend)):
        raise TypeError(
            f"{caller}: got {backend_type!r}; allowed: a backend class such as dml.MPIBackend, "
            "dml.NCCLBackend or dml.LocalBackend"
        )


def _spawned(backend_type: type[Backend]) -> Backend | None:
    if issubclass(LocalBackend, backend_type):
        return current_spawned_backend()
    return None


def initialize(backend_type: type[Backend], **options: Any) -> None:
    """Set up ``backend_type`` for this process (start MPI, pick a GPU...).

    Calling it again for an initialized type does nothing; a ``RuntimeWarning`` says so
    when that call passes options that differ from the first call's (they are ignored).

    Args:
        backend_type: ``dml.MPIBackend``, ``dml.NCCLBackend`` or ``dml.LocalBackend`` (the class).
        **options: passed to the backend's constructor (see each backend).

    Example:
        >>> dml.initialize(dml.LocalBackend)
    """
    _check_type(backend_type, "initialize")
    if _spawned(backend_type) is not None:
        return
    with _lock:
        if backend_type not in _instances:
            _instances[backend_type] = backend_type(**options)
            _options[backend_type] = dict(options)
            return
        first = _options.get(backend_type, {})
    if options and not _same_options(options, first):
        name = backend_type.__name__
        warnings.warn(
            f"initialize: dml.{name} is already initialized with options {first}; this call's options "
            f"{options} are ignored (a second initialize does nothing)",
            RuntimeWarning,
            stacklevel=2,
        )


def _same_options(given: dict[str, Any], first: dict[str, Any]) -> bool:
    """Whether every option of ``given`` was passed with the same value to the first call."""
    try:
        return all(k in first and bool(first[k] == v) for k, v in given.items())
    except Exception:  # values that cannot be compared (arrays): treat as different
        return False


def initialized(backend_type: type[Backend]) -> bool:
    """Whether ``initialize(backend_type)`` has run in this process."""
    _check_type(backend_type, "initialized")
    return _spawned(backend_type) is not None or backend_type in _instances


def get_distributed_backend(backend_type: type[B]) -> B:
    """The process's instance of ``backend_type``, created by ``initialize``.

    Raises:
        RuntimeError: ``initialize(backend_type)`` was not called first.

    Example:
        >>> backend = dml.get_distributed_backend(dml.LocalBackend)
    """
    _check_type(backend_type, "get_distributed_backend")
    spawned = _spawned(backend_type)
    if spawned is not None:
        return spawned  # type: ignore[return-value]
    try:
        return _instances[backend_type]  # type: ignore[return-value]
    except KeyError:
        name = backend_type.__name__
        raise RuntimeError(
            f"get_distributed_backend: {name} is not initialized; call dml.initialize(dml.{name}) first"
        ) from None


def local_rank(backend: Backend) -> int:
    """This process's rank in the world, ``0 .. total_workers(backend)-1``."""
    check_backend(backend, "local_rank")
    return backend.rank


def total_workers(backend: Backend) -> int:
    """The number of ranks in the world."""
    check_backend(backend, "total_workers")
    return backend.size
