#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
date -u +%Y-%m-%dT%H:%MZ
timeout 110 python3 benchmarks/bench_serve.py --device cuda --reps 3 --arms server --out $OUT/loop.json --server-log $OUT/server.log > $OUT/loop.log 2>&1; echo exit $?
python3 -c "import json; d=json.load(open('$OUT/loop.json'))['server']; print(d['tokens_per_s'], d['device_idle'], d['engine_loop'])"
