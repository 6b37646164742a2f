export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_paged_prefix.py tests/ops/test_triton_prefix.py 2>&1 | tail -6
for spec in "32:8 16" "32:8 64" "16:1 16"; do set -- $spec
  timeout 150 python3 benchmarks/bench_kernel.py --heads $1 --contexts 8192 32768 131072 --batches 1 8 --arms ours copy \
    --fill --page-size $2 --out $OUT/paged_${1/:/_}_p$2.json 2>&1 | grep -v -i warn | tail -9
done
