#!/usr/bin/env bash
# One GPU, one device call: the pool against rows at equal KV bytes on a long-tailed trace,
# then prefix caching on a multi-turn chat trace.  Logs and JSON go to $OUT.
#   bash benchmarks/pool_gpu_traces.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee "$OUT/env.txt"
cd benchmarks
timeout 240 python3 bench_prefix_cache.py --watchdog 220 --out "$OUT/prefix_cache.json" > "$OUT/prefix_cache.log" 2>&1
echo "prefix cache exit $?"; tail -n 4 "$OUT/prefix_cache.log" | cut -c1-600
timeout 320 python3 bench_pool_capacity.py --watchdog 300 --out "$OUT/pool_capacity.json" > "$OUT/pool_capacity.log" 2>&1
echo "pool capacity exit $?"; tail -n 4 "$OUT/pool_capacity.log" | cut -c1-600
