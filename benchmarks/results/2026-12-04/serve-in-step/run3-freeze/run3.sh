#!/usr/bin/env bash
# Session run 3: the shipped pair's server with the heap frozen after warm-up, against the same
# code without the freeze (nofreeze_serve/), then frozen again; pauses counted apart.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; grep -h "device_idle" $OUT/$name.log | sed 's/.*"tokens_per_s": \([0-9.]*\).*"device_idle": /tok\/s \1 idle /' | cut -c1-400; }
ph freeze_1 130 python3 benchmarks/bench_serve.py --device cuda --reps 3 --out $OUT/freeze_1.json --server-log $OUT/server_f1.log
ph nofreeze 110 python3 benchmarks/bench_serve.py --device cuda --reps 3 --arms server --server-tree $PWD/nofreeze_serve --out $OUT/nofreeze.json --server-log $OUT/server_nf.log
ph freeze_2 110 python3 benchmarks/bench_serve.py --device cuda --reps 3 --arms server --out $OUT/freeze_2.json --server-log $OUT/server_f2.log
