#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
date -u +%Y-%m-%dT%H:%MZ
timeout 60 python3 -m pytest -q -m gpu tests/runtime/test_step_graph.py -k never_waits -p no:cacheprovider 2>&1 | tail -1
timeout 150 python3 benchmarks/bench_serve.py --device cuda --reps 3 --out $OUT/serve.json --server-log $OUT/server.log > $OUT/serve.log 2>&1; echo exit $?
python3 -c "
import json; d=json.load(open('$OUT/serve.json'))
for a in ('offline','server'): print(a, round(d[a]['tokens_per_s'],1), d[a]['device_idle'], d[a].get('engine_loop'))
print('ratio', d.get('server_over_offline'))"
