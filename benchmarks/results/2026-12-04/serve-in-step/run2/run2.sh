#!/usr/bin/env bash
# Session run 2: the shipped pair's server (pipes served inside the step), then the 8B shape:
# offline, the two-process server, and the one-process server of 57dc70c (old_serve/) in one run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-4} $OUT/$name.log | cut -c1-600; }
ph serve_tiny 120 python3 benchmarks/bench_serve.py --device cuda --reps 3 --out $OUT/serve.json --server-log $OUT/server.log
ph serve_8b 280 python3 benchmarks/bench_serve.py --device cuda --write-llama3-8b /tmp/llama3-8b --chunk-size 256 --requests 64 --reps 2 --out $OUT/serve-8b.json --server-log $OUT/server-8b.log
ph serve_8b_old 170 python3 benchmarks/bench_serve.py --device cuda --model /tmp/llama3-8b/target --draft /tmp/llama3-8b/draft --chunk-size 256 --requests 64 --reps 2 --arms server --server-tree $PWD/old_serve --out $OUT/serve-8b-old.json --server-log $OUT/server-8b-old.log
grep -h "one process\|pid" $OUT/server-8b.log $OUT/server-8b-old.log | head -4
