#!/usr/bin/env bash
# Issue #32's goal names batch 32 at 128 heads from 8K: the kernel at B=32, H=128, T=1, 8K beside
# B=8 8K and B=32 32K, fp16 and fp32 partials interleaved. From the repository root:
#   bash benchmarks/results/2026-12-06/mla-b32-8k/run.sh    # $OUT: where the logs go
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ date -u +%Y-%m-%dT%H:%MZ; echo "code: ${CODE_REV:-unknown} (the device copy's git head can be stale)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
PYTHONPATH=$PWD:$PWD/benchmarks timeout -k 5 150 python3 benchmarks/bench_latent_kernel.py --points 9 13 11 \
  --arms ours ours-fp32 einsum copy --out $OUT/mla_kernel.json > $OUT/mla_kernel.log 2>&1
echo "mla_kernel exit $?"; tail -n 12 $OUT/mla_kernel.log
