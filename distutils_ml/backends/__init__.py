"""Communication backends: the abstract contract and one module per backend."""

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.backends.local import LocalBackend

__all__ = ["Backend", "LocalBackend", "ReduceOp"]
