#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index but has PyTorch (e.g. the lent H100/H200 image:
# Python 3.12, torch, accelerate, transformers 5.17, no diffusers / trl / datasets). Downloads the versions this
# project is tested with, for CPython 3.12 on manylinux x86-64, into .whl/ (git-ignored). On that machine:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   python3 benchmarks/matrix.py gpu --only grpo-flux-lora64
set -euo pipefail
cd "$(dirname "$0")/.."
# What that image lacks or has too old; it has accelerate 1.15, huggingface_hub 1.33, safetensors, tokenizers,
# pyarrow, fsspec, xxhash, pandas.
# A call carries at most 64 MiB: these are about 23 (ftfy: diffusers' Wan image-to-video pipeline needs it).
wheels=(
    trl==1.16.0 diffusers==0.42.1 transformers==5.23.0 datasets==5.2.0 peft==0.21.2
    dill==0.4.1 multiprocess==0.70.19 ftfy==6.3.1 wcwidth==0.9.4
)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wheels[@]}" 2> >(grep -v "^WARNING: Location" >&2)
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/. On the GPU machine, from the repository root:"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl"
echo "  export PYTHONPATH=/tmp/site:\$PWD"
