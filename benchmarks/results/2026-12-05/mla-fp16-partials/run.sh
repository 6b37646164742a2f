#!/usr/bin/env bash
# Prepared 2026-12-05, not yet run (no GPU was lent that day): the seesaw kernel's slices as fp16 partials
# over their value half's largest magnitude against fp32 (the default), and chain_pv.patch (a pair's two
# value products queued back to back) timed beside the library's kernel. From the repository root:
#   bash benchmarks/results/2026-12-05/mla-fp16-partials/run.sh    # $OUT: where the logs go
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/benchmarks
{ date -u +%Y-%m-%dT%H:%MZ; echo "code: ${CODE_REV:-unknown} (the device copy's git head can be stale)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
ph() { local name=$1 s=$2; shift 2; echo "== $name $(date -u +%H:%M:%S)"; timeout -k 5 $s "$@" > $OUT/$name.log 2>&1; echo "$name exit $? $(date -u +%H:%M:%S)"; tail -n ${TAILN:-6} $OUT/$name.log; }
TAILN=3 ph pytest_gpu 200 python3 -m pytest -q -m gpu tests/ops/test_triton_latent.py -p no:cacheprovider
BESIDE="--beside /tmp/gluon_latent_chain_pv.py"
patch -o /tmp/gluon_latent_chain_pv.py dcp_compile/ops/gluon_latent.py < benchmarks/results/2026-12-05/mla-fp16-partials/chain_pv.patch || BESIDE=""
TAILN=10 ph phases 240 python3 benchmarks/exp_latent_phases.py --partials fp32 fp16 $BESIDE --out $OUT/phases.json
TAILN=30 ph mla_kernel 240 python3 benchmarks/bench_latent_kernel.py --arms ours ours-fp16 einsum copy --out $OUT/mla_kernel.json
