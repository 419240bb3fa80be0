"""Our NCCL allreduce against the raw CuPy NCCL call, on CUDA tensors (GPU machines only).

    mpiexec -n 2 python benchmarks/nccl.py [--sizes 4K,1M,64M] [--reps 50]

Both contenders reduce the same float32 CUDA tensor in place on torch's current stream;
each repetition is timed with CUDA events around ``inner`` back-to-back calls, and the
table reports the median time of each and the ratio dml / raw (target: within 1.05).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import distutils_ml as dml


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    dml.initialize(dml.NCCLBackend)
    backend = dml.get_distributed_backend(dml.NCCLBackend)
    comm = backend.nccl_comm
    rows = []
    for size in map(parse_size, args.sizes.split(",")):
        t = torch.ones(size // 4, device="cuda")
        stream = torch.cuda.current_stream()
        inner = max(1, min(100, (1 << 24) // size))

        def raw(t: torch.Tensor = t, stream: torch.cuda.Stream = stream) -> None:
            comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), 7, 0, stream.cuda_stream)  # float32, sum

        def ours(t: torch.Tensor = t) -> None:
            dml.allreduce(backend, t, dml.SUM)

        times: dict[str, list[float]] = {"raw_cupy_nccl": [], "dml": []}
        for rep in range(args.reps + 3):
            for name, fn in (("raw_cupy_nccl", raw), ("dml", ours))[:: 1 if rep % 2 else -1]:
                dml.barrier(backend)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                if rep >= 3:
                    times[name].append(start.elapsed_time(end) / inner * 1e3)  # µs
        raw_us, dml_us = statistics.median(times["raw_cupy_nccl"]), statistics.median(times["dml"])
        rows.append((size, raw_us, dml_us, dml_us / raw_us))
    if dml.local_rank(backend) == 0:
        print(f"| size | raw CuPy NCCL µs | dml µs | dml / raw | {dml.total_workers(backend)} ranks |")
        print("|---|---|---|---|---|")
        for size, raw_us, dml_us, ratio in rows:
            verdict = "PASS" if ratio <= 1.05 else "MISS"
            print(f"| {size} B | {raw_us:.1f} | {dml_us:.1f} | {ratio:.3f} | {verdict} (<= 1.05) |")


if __name__ == "__main__":
    main()
