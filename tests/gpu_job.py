"""GPU checks inside an MPI job: ``mpiexec -n N python tests/gpu_job.py BACKEND`` (BACKEND: nccl, staged, aware).

Every op and dtype on CUDA tensors against the same collective on CPU tensors (reduce_scatter
included: both forms, bool, empty rows, CuPy arrays, bad input), stream-ordering checks (a
kernel writes the buffer on a side stream right before the collective), synchronize +
DistributedOptimizer on a CUDA model (overlap on and off), the sharded optimizer (equal to the
unsharded one; its state consolidated on one rank, on the CPU, and the GPU memory that costs),
checkpoints, exact evaluation, the device of the communication thread's jobs, and buffers on
another GPU than the communicator's. With more ranks than GPUs, NCCL runs as a rehearsal
(``DML_NCCL_SHARE_DEVICE=1``: ranks share a GPU over loopback sockets). Rank 0 prints
``GPU CHECKS PASSED`` at the end. Runs only where a GPU is present.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile

import numpy as np
import torch

import distutils_ml as dml

import sharded_bodies

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
]
OPS = [dml.SUM, dml.PROD, dml.MAX, dml.MIN, dml.AVG]


def values(rank: int, dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 2 + 0.5).to(dtype)
    return torch.randint(0, 3, (n,), generator=g).to(dtype)


def check_every_op_and_dtype(backend: dml.Backend, cpu: dml.Backend) -> int:
    rank, checked = dml.local_rank(backend), 0
    for dtype in DTYPES:
        for op in OPS:
            if op is dml.AVG and not dtype.is_floating_point:
                continue
            x = values(rank, dtype)
            got = dml.allreduce(backend, x.cuda(), op).cpu()
            want = dml.allreduce(cpu, x.clone(), op)
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=f"{op} {dtype}")
            root = checked % dml.total_workers(backend)
            r = dml.reduce(backend, x.cuda(), op, root=root).cpu()
            if rank == root:
                torch.testing.assert_close(r.double(), want.double(), rtol=tol, atol=tol, msg=f"reduce {op} {dtype}")
            else:
                assert torch.equal(r, x), "reduce changed a non-root buffer"
            checked += 1
        b = dml.bcast(backend, values(rank, dtype).cuda(), root=0).cpu()
        assert torch.equal(b, values(0, dtype)), f"bcast {dtype}"
        out = torch.empty(dml.total_workers(backend), 1000, dtype=dtype, device="cuda")
        dml.allgather(backend, values(rank, dtype).cuda(), out)
        for k in range(dml.total_workers(backend)):
            assert torch.equal(out[k].cpu(), values(k, dtype)), f"allgather {dtype}"
    return checked


def check_reduce_scatter(backend: dml.Backend, cpu: dml.Backend) -> int:
    """reduce_scatter on CUDA tensors against the same call on CPU tensors, every op and dtype, both forms
    (in place: the result is the view buf[rank], the other rows unchanged); bool, empty rows, a side stream
    that writes the buffer right before the call, CuPy arrays, and bad input raising before any byte moves."""
    rank, w = dml.local_rank(backend), dml.total_workers(backend)
    checked = 0
    for dtype in [*DTYPES, torch.bool]:
        for op in OPS:
            if (op is dml.AVG and not dtype.is_floating_point) or (
                dtype is torch.bool and op not in (dml.MAX, dml.MIN)
            ):
                continue
            x = torch.stack([values(rank * w + k, dtype, 250) for k in range(w)])  # (w, 250): row k goes to rank k
            if dtype is torch.bool:
                x = x > 0
            want = dml.reduce_scatter(cpu, x.clone(), torch.empty(250, dtype=dtype), op)
            got = dml.reduce_scatter(backend, x.cuda(), torch.empty(250, dtype=dtype, device="cuda"), op).cpu()
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            torch.testing.assert_close(
                got.double(), want.double(), rtol=tol, atol=tol, msg=f"reduce_scatter {op} {dtype}"
            )
            buf = x.cuda()
            row = dml.reduce_scatter(backend, buf, op)
            assert row.data_ptr() == buf[rank].data_ptr() and row.shape == (250,), "not the view buf[rank]"
            torch.testing.assert_close(
                row.cpu().double(), want.double(), rtol=tol, atol=tol, msg=f"in place {op} {dtype}"
            )
            others = [k for k in range(w) if k != rank]
            assert torch.equal(buf[others].cpu(), x[others]), f"in place changed other rows ({op} {dtype})"
            checked += 1
    empty = torch.empty(w, 0, device="cuda")
    assert dml.reduce_scatter(backend, empty, dml.SUM).shape == (0,)
    # A side stream writes the buffer right before the call issued on that stream.
    side = torch.cuda.Stream()
    send, recv = torch.zeros(w, 1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        send.fill_(rank + 1.0)
        dml.reduce_scatter(backend, send, recv, dml.SUM)
    side.synchronize()
    assert torch.all(recv == w * (w + 1) / 2), "reduce_scatter ran before the producing kernel finished"
    # Bad input: raised here, before anything is sent (the next call would mismatch or hang otherwise).
    for bad, words in (
        (lambda: dml.reduce_scatter(backend, torch.zeros(4 * w, device="cuda"), dml.SUM), "a flat buffer"),
        (lambda: dml.reduce_scatter(backend, send, torch.zeros(3, device="cuda"), dml.SUM), "recvbuf: got shape (3,)"),
        (lambda: dml.reduce_scatter(backend, torch.zeros(w + 1, 2, device="cuda"), dml.SUM), "leading axis"),
    ):
        try:
            bad()
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError: {words}")
    try:
        import cupy
    except ImportError:
        return checked
    with cupy.cuda.Stream(non_blocking=True):
        flat = cupy.arange(w * 3, dtype=cupy.float32) + rank
        shard = dml.reduce_scatter(backend, flat.reshape(w, 3), dml.SUM)  # in place, on a view of a flat array
        out = cupy.empty(3, dtype=cupy.float32)
        dml.reduce_scatter(backend, (cupy.arange(w * 3, dtype=cupy.float32) + rank).reshape(w, 3), out, dml.AVG)
        got, mean = shard.get(), out.get()
    expect = np.arange(rank * 3, rank * 3 + 3) * w + w * (w - 1) / 2
    assert (got == expect).all() and np.allclose(mean, expect / w), (got, mean, expect)
    return checked


def check_stream_ordering(backend: dml.Backend) -> None:
    """A side stream writes the buffers just before the collectives issued on that stream.

    The two-buffer form copies sendbuf into recvbuf even in a world of one, so a collective
    that ran before the producing kernel finished leaves zeros behind on any world size.
    """
    side = torch.cuda.Stream()
    w = dml.total_workers(backend)
    buf, send, recv = (torch.zeros(1 << 22, device="cuda") for _ in range(3))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write lands
        buf.fill_(dml.local_rank(backend) + 1.0)
        dml.allreduce(backend, buf, dml.SUM)
        torch.cuda._sleep(50_000_000)
        send.fill_(dml.local_rank(backend) + 1.0)
        dml.allreduce(backend, send, recv, dml.SUM)
    side.synchronize()
    assert torch.all(buf == w * (w + 1) / 2), "the collective read the buffer before the producing kernel finished"
    assert torch.all(recv == w * (w + 1) / 2), "the two-buffer collective ran before the producing kernel finished"


def check_cupy(backend: dml.Backend) -> None:
    """CuPy arrays, on a non-default CuPy stream: the result is ordered before CuPy's later work; with two GPUs,
    an array on a GPU that is not CuPy's current one is ordered on its own GPU's stream."""
    import cupy  # the GPU check needs CuPy (NCCLBackend does anyway): a missing CuPy fails it

    w, rank = dml.total_workers(backend), dml.local_rank(backend)
    with cupy.cuda.Stream(non_blocking=True):
        x = cupy.full(1 << 20, rank + 1, dtype=cupy.float32)
        dml.allreduce(backend, x, dml.SUM)
        total = float(x.sum())  # CuPy work on the same stream, after the collective
        out = cupy.empty((w, 3), dtype=cupy.int32)
        dml.allgather(backend, cupy.full(3, rank, dtype=cupy.int32), out)
        gathered = out.get()
    assert total == (1 << 20) * w * (w + 1) / 2, total
    assert (gathered == np.arange(w)[:, None]).all(), gathered
    if backend.takes_device_buffers and backend.device is not None:
        return  # NCCL: buffers on the communicator's GPU only (check_devices)
    if cupy.cuda.runtime.getDeviceCount() > 1:
        # An array on a GPU that is not CuPy's current one, written on that GPU's current CuPy stream after a
        # slow kernel: the collective must be ordered on that stream, not on the current GPU's.
        other = (cupy.cuda.Device().id + 1) % cupy.cuda.runtime.getDeviceCount()
        with cupy.cuda.Device(other):
            stream = cupy.cuda.Stream(non_blocking=True)
            stream.use()
            y = cupy.zeros(1 << 20, dtype=cupy.float32)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", other))):
                torch.cuda._sleep(50_000_000)
            y.fill(rank + 1)
        dml.allreduce(backend, y, dml.SUM)  # CuPy's current GPU is not y's here
        with cupy.cuda.Device(other):
            total = float(y.sum())
            cupy.cuda.Stream.null.use()
        assert total == (1 << 20) * w * (w + 1) / 2, f"the collective ran before the write on y's GPU ({total})"


def check_training(backend: dml.Backend) -> None:
    torch.manual_seed(dml.local_rank(backend))
    model = dml.synchronize(
        backend, torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
    )
    opt = dml.synchronize(backend, dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-2)))
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(
            model(torch.randn(16, 8, device="cuda")), torch.zeros(16, 1, device="cuda")
        ).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu().numpy()
    every = np.empty((dml.total_workers(backend), flat.size))
    dml.allgather(backend, flat, every)
    assert (every == every[0]).all(), "replicas differ"


def check_issue_11(backend: dml.Backend) -> None:
    """Object collectives, exact evaluation, buffers and synchronize of strided leaves, on CUDA tensors."""
    rank, w = dml.local_rank(backend), dml.total_workers(backend)
    assert dml.bcast_object(backend, {"r": rank}, root=w - 1) == {"r": w - 1}
    assert dml.allgather_object(backend, rank) == list(range(w))
    share = dml.DistributedDataContainer(backend, torch.arange(10.0))
    preds = torch.stack([share[i] for i in range(len(share))]).cuda() * 2
    gathered = dml.gather_unpadded(backend, preds, share)
    assert torch.equal(gathered.cpu(), torch.arange(10.0) * 2), gathered
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).cuda()
    handle = dml.broadcast_buffers(backend, model)
    model(torch.randn(8, 4, device="cuda") + rank)
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 4, device="cuda"))  # the first eval forward: root's buffers everywhere
    stats = model[1].running_mean.double().cpu().numpy()
    every = np.empty((w, stats.size))
    dml.allgather(backend, stats, every)
    assert (every == every[0]).all(), "buffers differ after the first evaluation forward"
    handle.remove()
    leaf = torch.full((4, 6), float(rank), device="cuda").t()  # non-contiguous on every rank
    dml.synchronize(backend, {"w": leaf}, root=0)
    assert (leaf == 0).all()


def check_issue_13(backend: dml.Backend) -> None:
    """Gradients reduced during backward on CUDA (on the communication thread's own stream, and at the end of
    backward): .grad is the average when backward() returns; clipping sees it; replicas stay identical."""
    rank, w = dml.local_rank(backend), dml.total_workers(backend)
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8)).cuda()
        plain = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8)).cuda()
        plain.load_state_dict(model.state_dict())
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        plain(x).square().mean().backward()
        local = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).double().cpu().numpy()
        every = np.empty((w, local.size))
        dml.allgather(backend, local, every)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap)
        model(x).square().mean().backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().cpu().numpy()
        np.testing.assert_allclose(got, every.mean(0), rtol=1e-5, atol=1e-6, err_msg=f"overlap={overlap}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu().numpy()
        dml.allgather(backend, flat, every := np.empty((w, flat.size)))
        assert (every == every[0]).all(), f"replicas differ (overlap={overlap})"


def mlp(seed: int, device: str = "cuda") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)
    ).to(device)


def train(backend: dml.Backend, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> np.ndarray:
    rank, device = dml.local_rank(backend), next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, device=device, generator=gen)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu().numpy()


def check_sharded(backend: dml.Backend, device: str = "cuda") -> dict:
    """The sharded optimizer on CUDA (overlap on and off) steps as the unsharded one; its state_dict consolidates
    on one rank, on the CPU, and loads back; the GPU memory of both stays at the shard plus one entry."""
    for overlap in (False, True):
        plain, sharded = mlp(0, device), mlp(0, device)
        # SGD with momentum: linear in the gradients, so a different summation order stays within rounding.
        a = dml.DistributedOptimizer(
            backend, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), overlap=overlap
        )
        b = dml.DistributedOptimizer(
            backend, torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9), overlap=overlap, shard_state=True
        )
        want, got = train(backend, plain, a, 4), train(backend, sharded, b, 4)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"sharded != unsharded ({overlap=})")
        full = b.state_dict()
        if dml.local_rank(backend) == 0:
            assert full is not None and all(
                v.device.type == "cpu" for entry in full["state"].values() for v in entry.values() if torch.is_tensor(v)
            ), "the consolidated state is not on the CPU"
            ref = a.state_dict()["state"]
            for i, entry in ref.items():
                torch.testing.assert_close(
                    full["state"][i]["momentum_buffer"], entry["momentum_buffer"].cpu(), rtol=1e-4, atol=1e-6
                )
        every = b.state_dict(to=None)
        b.load_state_dict(every)
        assert train(backend, sharded, b, 1).shape == want.shape
    return sharded_bodies.state_memory_body(backend, device)


def check_checkpoint(backend: dml.Backend, device: str = "cuda") -> None:
    """dml.save / dml.load of a CUDA model, both optimizer forms: a resumed run ends where an uninterrupted one does."""
    folder = dml.bcast_object(backend, tempfile.mkdtemp() if dml.local_rank(backend) == 0 else None, root=0)
    path = os.path.join(folder, "gpu.pt")
    for shard in (False, True):
        model = mlp(1, device)
        opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-3), shard_state=shard)
        train(backend, model, opt, 2)
        dml.save(backend, {"model": model, "opt": opt}, path)
        straight = train(backend, model, opt, 2)
        model = mlp(2, device)
        opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-3), shard_state=shard)
        ckpt = dml.load(backend, path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        resumed = train(backend, model, opt, 2)
        np.testing.assert_allclose(resumed, straight, rtol=1e-6, atol=1e-7, err_msg=f"resume ({shard=})")


def check_devices(backend: dml.Backend) -> str:
    """The communication thread's jobs run on this rank's device; a buffer on another GPU than the communicator's
    is refused before any call (only with two GPUs or more)."""
    here = torch.cuda.current_device()
    seen: list[int] = []
    backend.comm_thread().submit(lambda: seen.append(torch.cuda.current_device()))
    backend.comm_thread().wait()
    assert seen == [here], f"a communication-thread job ran on cuda:{seen[0]}, not this rank's cuda:{here}"
    if backend.device is None or torch.cuda.device_count() < 2:
        return "other-GPU buffer: not checked (one GPU, or a backend that takes any GPU)"
    other = (backend.device + 1) % torch.cuda.device_count()
    try:
        dml.allreduce(backend, torch.ones(4, device=f"cuda:{other}"), dml.SUM)
    except ValueError as e:
        assert f"cuda:{other}" in str(e) and f"cuda:{backend.device}" in str(e), str(e)
    else:
        raise AssertionError("a buffer on another GPU than the communicator's was not refused")
    return "other-GPU buffer: refused"


def check_duplicate(backend: dml.Backend) -> None:
    """A duplicate backend on the same GPU reduces like the original."""
    dup = backend.duplicate()
    assert type(dup) is type(backend) and dup.device == backend.device, (dup, dup.device, backend.device)
    x = torch.full((5,), float(backend.rank + 1), device="cuda")
    dml.allreduce(dup, x, dml.SUM)
    w = backend.size
    assert torch.equal(x.cpu(), torch.full((5,), w * (w + 1) / 2)), x


def main(kind: str) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    if kind == "nccl":
        dml.initialize(dml.NCCLBackend)
        backend = dml.get_distributed_backend(dml.NCCLBackend)
    else:
        dml.initialize(dml.MPIBackend, gpu_aware=kind == "aware")
        backend = dml.get_distributed_backend(dml.MPIBackend)
        torch.cuda.set_device(backend.node_local_rank % torch.cuda.device_count())
    cpu = dml.MPIBackend()
    n = check_every_op_and_dtype(backend, cpu)
    n += check_reduce_scatter(backend, cpu)
    check_stream_ordering(backend)
    check_cupy(backend)
    check_training(backend)
    check_issue_11(backend)
    check_issue_13(backend)
    memory = check_sharded(backend)
    check_checkpoint(backend)
    devices = check_devices(backend)
    check_duplicate(backend)
    dml.print(backend, f"sharded state memory: {memory}")
    dml.barrier(backend)
    if dml.local_rank(backend) == 0:
        what = f"{n} op/dtype cases, CuPy arrays checked, {devices}"
        print(f"GPU CHECKS PASSED: {kind} on {dml.total_workers(backend)} ranks, {what}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
