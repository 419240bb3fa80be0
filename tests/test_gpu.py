"""GPU paths: NCCLBackend and CUDA buffers on MPI (staged, CUDA-aware) and LocalBackend.

Without a GPU these skip with the reason; scripts/gpu-check.sh runs them on a GPU machine.
Only the CPU-checkable parts (clear errors) run everywhere.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import distutils_ml as dml

from mpirun import requires_mpi, run_mpi

HAVE_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device on this machine (run scripts/gpu-check.sh on one)")
needs_nccl = pytest.mark.skipif(
    not HAVE_GPU or importlib.util.find_spec("cupy") is None,
    reason='NCCL tests need a CUDA device and CuPy: pip install "distutils-ml[cuda]"',
)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_nccl_without_cupy_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r'pip install "distutils-ml\[cuda\]"'):
        dml.initialize(dml.NCCLBackend)
    assert not dml.initialized(dml.NCCLBackend)


def test_meta_tensor_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match="device 'meta' is not supported"):
        dml.allreduce(dml.LocalBackend(), torch.zeros(2, device="meta"), dml.SUM)


@needs_gpu
def test_staged_cuda_tensors_on_simulated_ranks() -> None:
    def fn(b: dml.Backend) -> list[float]:
        x = torch.full((5,), float(dml.local_rank(b) + 1), device="cuda", dtype=torch.bfloat16)
        dml.allreduce(b, x, dml.AVG)
        out = torch.empty(dml.total_workers(b), 5, device="cuda", dtype=torch.bfloat16)
        dml.allgather(b, x, out)
        return out.float().cpu().reshape(-1).tolist()

    results = dml.LocalBackend.spawn(3, fn, timeout=60)
    assert results[0] == [2.0] * 15 and all(r == results[0] for r in results)


@needs_gpu
@requires_mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_mpi_staged_cuda_buffers(ranks: int) -> None:
    job = run_mpi(ranks, ["tests/gpu_job.py", "staged"], timeout=300)
    assert job.returncode == 0 and "GPU CHECKS PASSED" in job.output, job.output[-6000:]


@needs_nccl
@requires_mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_nccl_backend(ranks: int) -> None:
    if ranks > torch.cuda.device_count():
        pytest.skip(f"NCCL needs one GPU per rank: {ranks} ranks, {torch.cuda.device_count()} GPU(s)")
    job = run_mpi(ranks, ["tests/gpu_job.py", "nccl"], timeout=300)
    assert job.returncode == 0 and "GPU CHECKS PASSED" in job.output, job.output[-6000:]


def test_device_choice_errors_are_clear_before_any_gpu_work() -> None:
    from distutils_ml.backends.nccl import _pick_device

    assert _pick_device(False, 0, 1, 0) is None  # leave devices alone
    with pytest.raises(TypeError, match="cuda_devices: got '0'"):
        _pick_device("0", 0, 1, 0)
    if torch.version.cuda is None:
        with pytest.raises(RuntimeError, match="CPU-only build"):
            _pick_device(None, 0, 1, 0)
    elif not HAVE_GPU:
        with pytest.raises(RuntimeError, match="sees no CUDA device"):
            _pick_device(None, 0, 1, 0)
    else:
        n = torch.cuda.device_count()
        assert _pick_device(None, n - 1, n, 0) == n - 1
        with pytest.raises(RuntimeError, match="one GPU per process"):
            _pick_device(None, 0, n + 1, 0)
        with pytest.raises(ValueError, match="one device per process"):
            _pick_device([0], 1, 2, 1)
