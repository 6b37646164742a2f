#!/usr/bin/env bash
# One GPU: the paged prefix kernels' GPU tests, then each against the unpaged kernel at the
# same bytes (bench_kernel.py --page-size), in one device call.  Logs and JSON go to $OUT.
#   bash benchmarks/paged_gpu_check.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_paged_prefix.py tests/ops/test_triton_prefix.py \
  tests/ops/test_triton_flash.py > "$OUT/pytest_gpu.log" 2>&1
echo "gpu tests exit $?"; tail -n 3 "$OUT/pytest_gpu.log"
for spec in "32:8 16" "32:8 64" "16:1 16" "8:1 64"; do
  set -- $spec
  timeout 150 python3 benchmarks/bench_kernel.py --heads "$1" --contexts 8192 32768 131072 --batches 1 8 --arms ours copy \
    --fill --page-size "$2" --out "$OUT/paged_${1/:/_}_p$2.json" > "$OUT/paged_${1/:/_}_p$2.log" 2>&1
  echo "== heads $1, page $2: exit $?"; tail -n 9 "$OUT/paged_${1/:/_}_p$2.log"
done
