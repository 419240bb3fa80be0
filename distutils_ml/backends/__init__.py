"""Communication backends: the abstract contract and one module per backend."""

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.backends.local import LocalBackend
from distutils_ml.backends.mpi import MPIBackend
from distutils_ml.backends.nccl import NCCLBackend

__all__ = ["Backend", "LocalBackend", "MPIBackend", "NCCLBackend", "ReduceOp"]
