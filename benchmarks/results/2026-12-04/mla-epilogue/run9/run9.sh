#!/usr/bin/env bash
# Session run 9: the seesaw epilogue forms (staging swizzled, unswizzled, direct stores, bf16 partials).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-6} $OUT/$name.log; }
TAILN=4 ph pytest_gpu 240 python3 -m pytest -q -m gpu tests/ops/test_triton_latent.py -p no:cacheprovider -k "seesaw or switch"
TAILN=14 ph times 150 python3 run9_times.py
TAILN=60 ph mla_kernel 240 python3 benchmarks/bench_latent_kernel.py --points 5 6 7 8 9 10 11 12 --arms ours seesaw-unswizzled seesaw-direct seesaw-bf16 einsum copy --out $OUT/mla_kernel.json
