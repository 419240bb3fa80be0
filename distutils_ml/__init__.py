"""distutils_ml: data-parallel training of PyTorch models over MPI, NCCL or threads.

Backend-first functions in the style of Lux.jl's ``DistributedUtils``::

    import distutils_ml as dml

    dml.initialize(dml.LocalBackend)
    backend = dml.get_distributed_backend(dml.LocalBackend)
    dml.allreduce(backend, grads, dml.AVG)
"""

from distutils_ml.amp import ShardedGradScaler
from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.backends.local import LocalBackend
from distutils_ml.backends.mpi import MPIBackend
from distutils_ml.backends.nccl import NCCLBackend
from distutils_ml.batchnorm import SyncBatchNorm, allreduce_autograd, convert_sync_batchnorm
from distutils_ml.buffers import broadcast_buffers
from distutils_ml.checkpoint import load, save
from distutils_ml.collectives import allgather, allreduce, barrier, bcast, reduce, reduce_scatter
from distutils_ml.data import DistributedDataContainer, UnpaddedShare
from distutils_ml.evaluation import gather_unpadded
from distutils_ml.objects import allgather_object, bcast_object
from distutils_ml.observations import getobs, numobs
from distutils_ml.optimizer import (
    BackwardReduction,
    DistributedOptimizer,
    allreduce_gradients,
    reduce_gradients_in_backward,
)
from distutils_ml.printing import print
from distutils_ml.registry import get_distributed_backend, initialize, initialized, local_rank, total_workers
from distutils_ml.rng import rng_state, rng_state_all, set_rng_state, set_rng_state_all
from distutils_ml.sharded import ShardedOptimizer
from distutils_ml.sparse import sparse_allreduce
from distutils_ml.streams import split_iterable
from distutils_ml.synchronize import synchronize
from distutils_ml.trainstate import TrainState
from distutils_ml.uneven import join
from distutils_ml.watchdog import CollectiveMismatchError, StallError

SUM = ReduceOp.SUM
PROD = ReduceOp.PROD
MAX = ReduceOp.MAX
MIN = ReduceOp.MIN
AVG = ReduceOp.AVG

__version__ = "0.1.0"

__all__ = [
    "AVG",
    "BackwardReduction",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "Backend",
    "CollectiveMismatchError",
    "DistributedDataContainer",
    "DistributedOptimizer",
    "LocalBackend",
    "MPIBackend",
    "NCCLBackend",
    "ReduceOp",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "StallError",
    "SyncBatchNorm",
    "TrainState",
    "UnpaddedShare",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_autograd",
    "allreduce_gradients",
    "reduce_gradients_in_backward",
    "barrier",
    "bcast",
    "bcast_object",
    "broadcast_buffers",
    "convert_sync_batchnorm",
    "get_distributed_backend",
    "gather_unpadded",
    "getobs",
    "initialize",
    "initialized",
    "join",
    "load",
    "local_rank",
    "numobs",
    "print",
    "reduce",
    "reduce_scatter",
    "rng_state",
    "rng_state_all",
    "save",
    "set_rng_state",
    "set_rng_state_all",
    "sparse_allreduce",
    "split_iterable",
    "synchronize",
    "total_workers",
]
