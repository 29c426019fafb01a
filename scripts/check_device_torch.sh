#!/usr/bin/env bash
# The compiled GPU code path's CPU tests on the GPU machines' torch (docs/GPU.md, "The device's
# torch on CPU"). Dynamo differs between torch versions: the H200 (torch 2.11) broke ReLU's
# block graph where this machine's torch 2.13 did not. Downloads that torch's CUDA build (it
# imports and runs on CPU) with its CUDA libraries into DIR once (~4.6 GB, minutes), then runs
# the tests with it first on PYTHONPATH. Needs a package registry; nothing else is installed.
#   scripts/check_device_torch.sh                 # torch 2.11.0 into ~/.cache/remoe/torch-2.11.0
# (outside the checkout: 4.6 GB of torch's own code is no part of the project's tree)
#   TORCH=2.12.0 scripts/check_device_torch.sh    # another version
#   scripts/check_device_torch.sh -k capacity     # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
version="${TORCH:-2.11.0}"
dir="${DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/remoe/torch-$version}"
py="${PYTHON:-python3}"
if [ ! -f "$dir/.complete" ]; then
    wheels="$dir.wheels"
    "$py" -m pip download -q --no-deps -d "$wheels" "torch==$version"
    "$py" -m pip install -q --target "$dir" "$wheels"/torch-"$version"-*.whl
    rm -rf "$wheels"
    touch "$dir/.complete"
fi
got="$(PYTHONPATH="$dir" "$py" -c 'import torch; print(torch.__version__)')"
case "$got" in
    "$version"*) ;;
    *) echo "check_device_torch: expected torch $version from $dir, got $got" >&2; exit 1 ;;
esac
echo "torch $got from $dir"
export PYTHONPATH="$dir:$root/src" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$py" -m pytest -q -p no:cacheprovider tests/bench/test_device_stack.py \
    tests/train/test_capacity_plan.py tests/train/test_compile.py \
    tests/model/test_capacity_plan.py tests/train/test_step_options.py "$@"
