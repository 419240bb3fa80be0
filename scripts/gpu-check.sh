#!/usr/bin/env bash
# The GPU subset, on a machine with an NVIDIA GPU (not CI): NCCL world of one (and of two ranks
# where there are two GPUs: NCCL needs one GPU per rank), the staged MPI path on 1 and 2 ranks
# sharing the GPU, CUDA-aware MPI if the MPI supports it (every collective, reduce_scatter through
# ncclReduceScatter / Reduce_scatter_block / staged included), stream ordering, CuPy arrays, training
# on CUDA, object collectives, exact evaluation, buffer broadcasts and strided synchronize on CUDA,
# gradients reduced during backward on CUDA (overlap on a stream of its own, and at the end of backward),
# SyncBatchNorm on CUDA tensors (simulated ranks, staged MPI on 2 ranks, NCCL), the quickstart on CUDA,
# and our NCCL allreduce against the raw CuPy NCCL call.
# Usage: bash scripts/gpu-check.sh   (from the repository root, in an environment with
#        distutils-ml[test,mpi,cuda] or [cuda13] installed).
set -uo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi PYTHONPATH=tests${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch, cupy; from cupy.cuda import nccl; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, 'nccl', nccl.get_version())"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nccl_ranks=$(( gpus < 2 ? 1 : 2 ))
status=0
python -m pytest -q -p no:cacheprovider tests/test_gpu.py || status=1
python -m pytest -q -p no:cacheprovider tests/test_batchnorm.py -k gpu || status=1
for n in $(seq 1 "$nccl_ranks"); do
  mpiexec --oversubscribe -n "$n" python tests/gpu_job.py nccl || status=1
done
for n in 1 2; do
  mpiexec --oversubscribe -n "$n" python tests/gpu_job.py staged || status=1
done
if ompi_info --parsable --all 2>/dev/null | grep -q "mpi_built_with_cuda_support:value:true"; then
  mpiexec --oversubscribe -n 2 python tests/gpu_job.py aware || status=1
else
  echo "CUDA-aware MPI: not available in this MPI build; skipped"
fi
python examples/quickstart.py --device cuda --ranks 1 --steps 100 || status=1
mpiexec --oversubscribe -n "$nccl_ranks" python examples/quickstart.py --device cuda --backend nccl --steps 100 || status=1
mpiexec --oversubscribe -n "$nccl_ranks" python benchmarks/nccl.py || status=1
exit $status
