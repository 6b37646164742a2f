#!/usr/bin/env bash
# Session run 1: MLA seesaw after the kv_len fix (GPU tests, split sweep, kernel grid, V2-Lite step),
# then the shipped pair's server with the send moved into the step.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-6} $OUT/$name.log; }
ph pytest_gpu 200 python3 -m pytest -q -m gpu tests/ops/test_triton_latent.py -p no:cacheprovider
TAILN=14 ph splits 120 python3 benchmarks/bench_latent_kernel.py --splits 4 6 12 16 24 32 --out $OUT/splits.json
TAILN=30 ph e2e_v2lite 200 python3 benchmarks/bench_e2e.py --model v2lite --regional --arms one --contexts 32768,131072,524288 --batches 8 --verify-batches 8 --edge '' --out $OUT/e2e_v2lite.json
TAILN=12 ph serve_tiny 170 python3 benchmarks/bench_serve.py --device cuda --reps 3 --out $OUT/serve.json --server-log $OUT/server.log
