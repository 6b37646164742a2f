#!/usr/bin/env bash
# fp16 partials as the seesaw kernel's default: the GPU tests, the kernel grid with fp32 partials interleaved (ours-fp32),
# and the V2-Lite-shaped step with the library's default (fp16) and with a copy of the tree whose default is
# fp32, one after the other in this run. From the repository root:
#   bash benchmarks/results/2026-12-05/mla-fp16-default/run.sh    # $OUT: where the logs go; TESTS=0 skips the tests
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
CONTEXTS=32768,131072   # 512K (B=8, 27 layers) needs 130 GB of cache: only where the card holds it
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 120000 ] && CONTEXTS=$CONTEXTS,524288
{ date -u +%Y-%m-%dT%H:%MZ; echo "code: ${CODE_REV:-unknown} (the device copy's git head can be stale)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-6} $OUT/$name.log; }
rm -rf /tmp/fp32tree && mkdir /tmp/fp32tree && cp -r dcp_compile benchmarks /tmp/fp32tree/
sed -i 's/^PARTIALS = ("fp16", "fp32")$/PARTIALS = ("fp32", "fp16")/' /tmp/fp32tree/dcp_compile/ops/gluon_latent.py
for tree in $PWD /tmp/fp32tree; do (cd $tree && PYTHONPATH=$tree python3 -c 'from dcp_compile.ops import gluon_latent as g
print(g.__file__, "partials default", g.seesaw_attention.__defaults__[-1])'); done
E2E="--model v2lite --regional --arms one --contexts $CONTEXTS --batches 8 --verify-batches 8 --edge ''"
[ "${TESTS:-1}" = 0 ] || PYTHONPATH=$PWD:$PWD/benchmarks TAILN=3 ph pytest_gpu 200 python3 -m pytest -q -m gpu tests/ops/test_triton_latent.py -p no:cacheprovider
PYTHONPATH=$PWD:$PWD/benchmarks TAILN=20 ph mla_kernel 150 python3 benchmarks/bench_latent_kernel.py --arms ours ours-fp32 einsum copy --out $OUT/mla_kernel.json
PYTHONPATH=$PWD:$PWD/benchmarks TAILN=9 ph e2e_fp16 190 bash -c "python3 benchmarks/bench_e2e.py $E2E --out $OUT/e2e_fp16.json"
PYTHONPATH=/tmp/fp32tree:/tmp/fp32tree/benchmarks TAILN=9 ph e2e_fp32 190 bash -c "cd /tmp/fp32tree && python3 benchmarks/bench_e2e.py $E2E --out $OUT/e2e_fp32.json"
