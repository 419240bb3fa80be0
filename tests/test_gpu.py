"""GPU paths: NCCLBackend and CUDA buffers on MPI (staged, CUDA-aware) and LocalBackend.

Without a GPU these skip with the reason; scripts/gpu-check.sh runs them on a GPU machine.
Only the CPU-checkable parts (clear errors) run everywhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

import distutils_ml as dml
from distutils_ml.backends.nccl import choose_devices, shared_gpus
from distutils_ml.collectives import check_device

from mpirun import requires_mpi, run_mpi

HAVE_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.gpu


def needs_nccl(test: Callable[..., None]) -> Callable[..., None]:
    """A GPU test that also needs CuPy's NCCL (on a GPU machine, a skip for its absence is a failure there)."""
    no_cupy = importlib.util.find_spec("cupy") is None
    return pytest.mark.gpu(pytest.mark.skipif(no_cupy, reason='needs CuPy: pip install "distutils-ml[cuda]"')(test))


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
@pytest.mark.gpu_job
@requires_mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_mpi_staged_cuda_buffers(ranks: int) -> None:
    job = run_mpi(ranks, ["tests/gpu_job.py", "staged"], timeout=300)
    assert job.returncode == 0 and "GPU CHECKS PASSED" in job.output, job.output[-6000:]


@needs_nccl
@pytest.mark.gpu_job
@requires_mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_nccl_backend(ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if ranks > torch.cuda.device_count():  # the rehearsal: ranks share a GPU over NCCL's loopback sockets
        monkeypatch.setenv("DML_NCCL_SHARE_DEVICE", "1")
    job = run_mpi(ranks, ["tests/gpu_job.py", "nccl"], timeout=300)
    assert job.returncode == 0 and "GPU CHECKS PASSED" in job.output, job.output[-6000:]


def test_device_choice_by_node_local_rank_where_a_node_sees_the_same_gpus() -> None:
    gpus = ["GPU-a", "GPU-b"]
    hosts = ["n0", "n0", "n1", "n1"]
    assert choose_devices(None, [gpus] * 4, hosts, [0, 1, 0, 1]) == [0, 1, 0, 1]
    assert choose_devices([1, 0], [gpus] * 4, hosts, [0, 1, 0, 1]) == [1, 0, 1, 0]
    # more ranks than GPUs: node_local_rank % n, which shared_gpus then names
    chosen = choose_devices(None, [["GPU-a"]] * 3, ["n0"] * 3, [0, 1, 2])
    assert chosen == [0, 0, 0]
    message = shared_gpus(["GPU-a"] * 3, ["n0"] * 3)
    assert message is not None and "ranks [0, 1, 2] on n0 would drive the same GPU (GPU-a)" in message
    assert "3 processes but 1 GPU(s)" in message and "DML_NCCL_SHARE_DEVICE=1" in message


def test_one_visible_gpu_per_rank_is_accepted() -> None:
    # SLURM --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank: each rank sees "device 0", a different GPU.
    visible = [["GPU-a"], ["GPU-b"], ["GPU-c"]]
    chosen = choose_devices(None, visible, ["n0"] * 3, [0, 1, 2])
    assert chosen == [0, 0, 0]
    assert shared_gpus([visible[r][0] for r in range(3)], ["n0"] * 3) is None
    # overlapping sets on a node: each rank takes the first GPU no lower rank of its node took
    visible = [["GPU-a", "GPU-b"], ["GPU-a", "GPU-b", "GPU-c"], ["GPU-x", "GPU-y"]]
    chosen = choose_devices(None, visible, ["n0", "n0", "n1"], [0, 1, 0])
    assert chosen == [0, 1, 0]
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-x"], ["n0", "n0", "n1"]) is None


def test_device_choice_errors_name_the_rank() -> None:
    chosen = choose_devices([0], [["GPU-a", "GPU-b"]] * 2, ["n0"] * 2, [0, 1])
    assert chosen[0] == 0 and isinstance(chosen[1], str) and "one device per process" in chosen[1]
    chosen = choose_devices([0, 5], [["GPU-a", "GPU-b"]] * 2, ["n0"] * 2, [0, 1])
    assert isinstance(chosen[1], str) and "this node has 0..1" in chosen[1]
    assert choose_devices(None, [["GPU-a"], []], ["n0"] * 2, [0, 1])[1] == "no GPU"


def test_share_device_option() -> None:
    from distutils_ml.backends.nccl import _share_option

    assert _share_option(True) is True and _share_option(False) is False
    with pytest.raises(TypeError, match="share_device: got 'yes'"):
        _share_option("yes")  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DML_NCCL_SHARE_DEVICE", "1")
        assert _share_option(None) is True
        mp.setenv("DML_NCCL_SHARE_DEVICE", "maybe")
        with pytest.raises(ValueError, match="DML_NCCL_SHARE_DEVICE: got 'maybe'"):
            _share_option(None)
        mp.delenv("DML_NCCL_SHARE_DEVICE")
        assert _share_option(None) is False


def test_cuda_devices_type_is_checked_before_any_gpu_work() -> None:
    with pytest.raises(TypeError, match="cuda_devices: got '0'"):
        dml.NCCLBackend(cuda_devices="0")


def test_a_buffer_on_another_gpu_than_the_communicator_is_refused() -> None:
    class Bound(dml.LocalBackend):
        device = 1

    buf = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(
        ValueError, match=r"recvbuf: a buffer on cuda:0, but Bound's communicator on rank 0 is on cuda:1"
    ):
        check_device(Bound(), buf, "recvbuf")
    check_device(Bound(), SimpleNamespace(device=torch.device("cuda", 1)), "buf")
    check_device(dml.LocalBackend(), buf, "buf")  # device None: any GPU


def test_simulated_ranks_run_backward_on_their_own_thread() -> None:
    # CUDA backward passes would otherwise share autograd's device thread, and the end-of-backward
    # reduction of one simulated rank would block the others' (examples/quickstart.py --device cuda hung).
    assert torch._C._is_multithreading_enabled()
    assert dml.LocalBackend.spawn(2, lambda b: torch._C._is_multithreading_enabled()) == [False, False]


def test_jobs_of_the_communication_thread_run_on_the_submitters_device() -> None:
    from distutils_ml.commthread import current_cuda_device

    def run(b: dml.Backend) -> list[int | None]:
        seen: list[int | None] = []
        worker = b.comm_thread()
        worker.submit(lambda: seen.append(current_cuda_device()))
        worker.wait()
        return seen

    want = current_cuda_device()  # None without CUDA; the device where CUDA is initialized
    assert dml.LocalBackend.spawn(2, run) == [[want], [want]]


@needs_gpu
def test_gpu_jobs_follow_the_device_of_the_submitting_thread() -> None:
    last = torch.cuda.device_count() - 1
    seen: list[int] = []
    backend = dml.LocalBackend()
    with torch.cuda.device(last):
        backend.comm_thread().submit(lambda: seen.append(torch.cuda.current_device()))
    backend.comm_thread().wait()
    assert seen == [last]


@needs_gpu
@pytest.mark.parametrize("shard_state", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_optimizer_on_simulated_ranks_does_not_deadlock(overlap: bool, shard_state: bool) -> None:
    # Before the fix, the end-of-backward reduction of one simulated rank blocked autograd's CUDA thread,
    # which the other rank's backward needed: examples/quickstart.py --device cuda (2 simulated ranks) hung.
    def fn(b: dml.Backend) -> list[float]:
        # Simulated ranks share torch's global generator, so seeding it on each does not give equal
        # replicas (threads draw from it in turn): rank 0's weights reach every rank, as in a real script.
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
        model = dml.synchronize(b, model)
        opt = dml.DistributedOptimizer(
            b, torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, shard_state=shard_state
        )
        gen = torch.Generator("cuda").manual_seed(dml.local_rank(b))
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 8, device="cuda", generator=gen)).square().mean().backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()

    results = dml.LocalBackend.spawn(2, fn, timeout=60)
    assert results[0] == results[1], "replicas differ"
