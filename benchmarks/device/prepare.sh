#!/usr/bin/env bash
# Prepares, on a machine with the package registry, what benchmarks/device/checks.sh
# needs on a GPU machine that has PyTorch and Triton but no registry (the lent
# H100/H200): into .gpu/ (ignored by git; carried with the call)
#
#   .gpu/whl/          megatron-core 0.16.1 for Python 3.12 (the GPU machine's python3),
#                      and pydantic with what it needs: Megatron-LM's pretrain_gpt.py
#                      imports megatron.rl, which imports pydantic, and the machine's
#                      image has none (KINDS.md's package list)
#   .gpu/megatron-lm/  Megatron-LM's training code at tag core_v0.16.1, without its
#                      megatron/core (the wheel's is used): pretrain_gpt.py and what it imports
#
#   benchmarks/device/prepare.sh MEGATRON_LM_GIT_DIR [PYTHON]
#
# MEGATRON_LM_GIT_DIR: a clone of https://github.com/NVIDIA/Megatron-LM holding the
# tag core_v0.16.1 (a bare one will do). PYTHON: the pip to download with (default:
# .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
git_dir=${1:?usage: benchmarks/device/prepare.sh MEGATRON_LM_GIT_DIR [PYTHON]}
py=${2:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
tag=core_v0.16.1

git -C "$git_dir" rev-parse --verify -q "$tag^{commit}" >/dev/null \
  || { echo "prepare.sh: $git_dir has no tag $tag (git fetch --tags there)" >&2; exit 2; }

rm -rf .gpu.tmp && mkdir -p .gpu.tmp/whl .gpu.tmp/megatron-lm
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu.tmp/whl megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
git -C "$git_dir" archive "$tag" pretrain_gpt.py gpt_builders.py model_provider.py \
  mamba_builders.py megatron/training megatron/legacy megatron/post_training megatron/rl \
  | tar -x -C .gpu.tmp/megatron-lm
git -C "$git_dir" rev-parse "$tag^{commit}" > .gpu.tmp/megatron-lm/COMMIT
rm -rf .gpu && mv .gpu.tmp .gpu  # whole or not at all
du -sh .gpu/whl .gpu/megatron-lm
echo "ready: carry .gpu with benchmarks/device/checks.sh"
