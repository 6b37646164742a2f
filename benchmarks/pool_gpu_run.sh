#!/usr/bin/env bash
# One GPU, one device call each (logs and JSON go to $OUT):
#   bash benchmarks/pool_gpu_run.sh kernels   the paged step against the cascade over rows, serve's default
#                                             pool, the paged GPU tests, the paged flash kernel on a chunk
#   bash benchmarks/pool_gpu_run.sh traces    prefix caching on a multi-turn chat trace, then the pool
#                                             against rows at equal KV bytes on a long-tailed trace
#   bash benchmarks/pool_gpu_run.sh goals     one call for what a short lease allows: the paged step, the
#                                             chat trace, then the capacity trace, each cut off by its timeout
#   bash benchmarks/pool_gpu_run.sh capacity  the capacity trace alone, both arms, with a whole call's time
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee "$OUT/env.txt"
if [ "${1:-kernels}" = goals ]; then
  cd benchmarks
  timeout 170 python3 bench_paged_step.py --arms cascade paged --out "$OUT/paged_step.json" > "$OUT/paged_step.log" 2>&1
  echo "paged step exit $?"; tail -n 5 "$OUT/paged_step.log" | cut -c1-700
  timeout 120 python3 bench_prefix_cache.py --watchdog 110 --out "$OUT/prefix_cache.json" > "$OUT/prefix_cache.log" 2>&1
  echo "prefix cache exit $?"; tail -n 3 "$OUT/prefix_cache.log" | cut -c1-600
  timeout 230 python3 bench_pool_capacity.py --watchdog 220 --out "$OUT/pool_capacity.json" > "$OUT/pool_capacity.log" 2>&1
  echo "pool capacity exit $?"; tail -n 3 "$OUT/pool_capacity.log" | cut -c1-600
  exit 0
fi
if [ "${1:-kernels}" = capacity ]; then
  cd benchmarks
  timeout 560 python3 bench_pool_capacity.py --watchdog 550 --out "$OUT/pool_capacity.json" > "$OUT/pool_capacity.log" 2>&1
  echo "pool capacity exit $?"; tail -n 4 "$OUT/pool_capacity.log" | cut -c1-600
  exit 0
fi
if [ "${1:-kernels}" = traces ]; then
  cd benchmarks
  timeout 240 python3 bench_prefix_cache.py --watchdog 220 --out "$OUT/prefix_cache.json" > "$OUT/prefix_cache.log" 2>&1
  echo "prefix cache exit $?"; tail -n 4 "$OUT/prefix_cache.log" | cut -c1-600
  timeout 320 python3 bench_pool_capacity.py --watchdog 300 --out "$OUT/pool_capacity.json" > "$OUT/pool_capacity.log" 2>&1
  echo "pool capacity exit $?"; tail -n 4 "$OUT/pool_capacity.log" | cut -c1-600
  exit 0
fi
# serve's Starlette and uvicorn travel as wheels (carry .serve-wheels): the machine installs nothing from a network
if [ -d .serve-wheels ]; then
  python3 -m pip install -q --no-index --target /tmp/site .serve-wheels/*.whl > "$OUT/wheels.log" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
(cd benchmarks && timeout 170 python3 bench_paged_step.py --arms cascade paged --watchdog 160 --out "$OUT/paged_step.json") > "$OUT/paged_step.log" 2>&1
echo "paged step exit $?"; tail -n 4 "$OUT/paged_step.log" | cut -c1-900
(cd benchmarks && timeout 150 python3 gpu_serve_pool.py --watchdog 140 --log "$OUT/serve_server.log" --out "$OUT/serve_pool.json") > "$OUT/serve_pool.log" 2>&1
echo "serve pool exit $?"; tail -n 2 "$OUT/serve_pool.log" | cut -c1-600
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_paged_cache.py tests/ops/test_paged_prefix.py > "$OUT/pytest_gpu.log" 2>&1
echo "paged gpu tests exit $?"; tail -n 3 "$OUT/pytest_gpu.log"
timeout 90 python3 benchmarks/bench_paged_tiles.py --flash-tokens 2048 --points 32:8:2:32768 16:1:8:32768 \
  --out "$OUT/paged_flash.json" > "$OUT/paged_flash.log" 2>&1
echo "paged flash exit $?"; tail -n 6 "$OUT/paged_flash.log"
