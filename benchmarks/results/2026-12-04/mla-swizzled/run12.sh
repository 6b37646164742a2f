#!/usr/bin/env bash
# Session run 12: the library's seesaw kernel with its swizzled epilogue (GPU tests, phases, the kernel's points, V2-Lite step).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
{ date -u +%Y-%m-%dT%H:%MZ; git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-6} $OUT/$name.log; }
TAILN=3 ph pytest_gpu 240 python3 -m pytest -q -m gpu tests/ops/test_triton_latent.py -p no:cacheprovider
TAILN=4 ph phases 120 python3 benchmarks/exp_latent_phases.py --out $OUT/phases.json
TAILN=22 ph mla_kernel 240 python3 benchmarks/bench_latent_kernel.py --arms ours einsum copy --out $OUT/mla_kernel.json
TAILN=14 ph e2e_v2lite 200 python3 benchmarks/bench_e2e.py --model v2lite --regional --arms one --contexts 32768,131072,524288 --batches 8 --verify-batches 8 --edge '' --out $OUT/e2e_v2lite.json
