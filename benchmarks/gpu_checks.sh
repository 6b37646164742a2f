#!/usr/bin/env bash
# Everything the GPU machine checks in one call (device time is scarce):
#   1. bf16 DCP parity over NCCL on 2 GPUs, with Triton kernels in the Inductor output;
#   2. the CPU test suite (no full-Inductor tests) on that machine's torch, for API drift.
# Usage on the device machine, from the repository root:  bash benchmarks/gpu_checks.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
date -u +%Y-%m-%dT%H:%MZ | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/env.txt"
python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/env.txt"
echo "== gpu parity (2 ranks, NCCL, bf16)"
timeout -k 10 420 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_parity.py --json "$OUT/gpu_parity.json" 2>&1 | tee "$OUT/gpu_parity.log" | grep -v Warning
echo "gpu_parity exit: ${PIPESTATUS[0]}"
echo "== CPU suite on this machine's torch (not inductor)"
timeout -k 10 ${SUITE_SECONDS:-150} python3 -m pytest -q -x -m "not inductor" -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -15
echo "pytest exit: ${PIPESTATUS[0]}"
