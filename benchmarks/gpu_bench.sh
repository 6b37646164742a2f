#!/usr/bin/env bash
# The GPU benchmarks and checks in one device call, each phase under its own timeout (and watchdog).
# Usage on the device machine, from the repository root:
#   bash benchmarks/gpu_bench.sh parity suite      # bf16 DCP parity over NCCL (Triton kernels in the Inductor
#                      # output); the CPU test suite without the full-Inductor tests, on this machine's torch
#   bash benchmarks/gpu_bench.sh merge             # per-layer merge: all-gather against all-to-all
#   bash benchmarks/gpu_bench.sh e2e               # 8B-shaped decode step, DCP=2 vs DCP=1
#     (the DCP=N arm over all GPUs first, then the one-GPU arm's points spread over the
#      GPUs, one process per GPU side by side, so the 32-layer compiles overlap)
#   NPROC=4 bash benchmarks/gpu_bench.sh gate merge  # any group size: the speculative gate, the merge sweep
#     (GATE_ARGS=--cuda-graphs: the gate with the decoders' steps captured, collectives inside)
#   bash benchmarks/gpu_bench.sh kernel demo       # one GPU: kernel sweep; the demo on CUDA (--dcp $NPROC)
#   bash benchmarks/gpu_bench.sh gputests prefillkernels draft prefill  # long prompts: kernel tests on the GPU,
#                      # flash kernels against SDPA, the draft's share, chunked DCP prefill against one GPU's flash
#   bash benchmarks/gpu_bench.sh long              # 8 x 131072-token prompts prefilled and decoded at DCP=2
#   bash benchmarks/gpu_bench.sh specloop          # one GPU: the speculative loop against its captured graphs
#   bash benchmarks/gpu_bench.sh compile           # the demo's compile times: DCP=$NPROC cold, warm restart, DCP=1 cold
#   bash benchmarks/gpu_bench.sh gatebf16 gatesampled  # `dcp-compile gate` at DCP=$NPROC, bf16, 256 prompts
#   bash benchmarks/gpu_bench.sh tpkernel          # one GPU: the prefix kernels at TP x DCP's gathered-head shapes
#                      # (16:1 and 8:1 against 32:8; the latent kernel at H=16 and H=128), 32K and beyond
#   bash benchmarks/gpu_bench.sh mlasweep mlakernel    # one GPU: the latent kernel's tiles; it against einsum, SDPA, copy
#   bash benchmarks/gpu_bench.sh mlagate mlae2e        # MLA: the bf16 gate at DCP=$NPROC (512 prompts, greedy and
#                      # sampled); the V2-Lite-shaped decode/verify step at DCP=$NPROC against one GPU
# Logs and JSON go to $OUT (default /tmp/out); the tables are printed last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
NPROC=${NPROC:-2}
mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

phase() {  # name seconds script args...
  local name=$1 seconds=$2; shift 2
  echo "== $name (limit ${seconds}s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$seconds" python3 -m torch.distributed.run --nproc-per-node "$NPROC" "$@" \
    --watchdog $((seconds - 15)) > "$OUT/$name.log" 2>&1
  echo "$name exit: $? $(date -u +%H:%M:%S)"
}

single() {  # name seconds command...: one process, no torchrun
  local name=$1 seconds=$2; shift 2
  echo "== $name (limit ${seconds}s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit: $? $(date -u +%H:%M:%S)"
}

one_gpu_arms() {  # seconds: bench_e2e's one-GPU arm, point i on GPU i mod NPROC, then the combined tables
  local seconds=$1 i
  echo "== e2e one-GPU arm on $NPROC GPUs (limit ${seconds}s) $(date -u +%H:%M:%S)"
  for ((i = 0; i < NPROC; i++)); do
    CUDA_VISIBLE_DEVICES=$i timeout -k 10 "$seconds" python3 benchmarks/bench_e2e.py --arms one --share "$i/$NPROC" \
      --out "$OUT/e2e_one$i.json" --watchdog $((seconds - 15)) ${E2E_ARGS:-} > "$OUT/e2e_one$i.log" 2>&1 &
  done
  wait
  echo "e2e one-GPU arm done $(date -u +%H:%M:%S)"
  for ((i = 0; i < NPROC; i++)); do cat "$OUT/e2e_one$i.log" >> "$OUT/e2e.log"; rm -f "$OUT/e2e_one$i.log"; done
  # the combined JSON keeps every run's points; $OUT returns at most 8 files
  if [ -f "$OUT/e2e_dcp.json" ]; then
    python3 benchmarks/bench_e2e.py --combine "$OUT/e2e_dcp.json" "$OUT"/e2e_one*.json --out "$OUT/e2e.json" \
      ${E2E_ARGS:-} >> "$OUT/e2e.log" 2>&1 && rm -f "$OUT/e2e_dcp.json" "$OUT"/e2e_one*.json
  else
    echo "no DCP arm JSON (the DCP phase did not finish): the measured steps are in e2e.log" >> "$OUT/e2e.log"
  fi
}

demo_compile_times() {  # seconds: the demo three times, each with its own compile caches or a warm one
  local seconds=$1 caches
  caches=$(mktemp -d)
  : > "$OUT/compile.log"
  for run in "dcp$NPROC-cold:a:$NPROC" "dcp$NPROC-warm:a:$NPROC" "dcp1-cold:b:1"; do
    IFS=: read -r name dir size <<< "$run"
    echo "== compile $name (limit ${seconds}s) $(date -u +%H:%M:%S)"
    echo "== $name" >> "$OUT/compile.log"
    TORCHINDUCTOR_CACHE_DIR=$caches/$dir/inductor TRITON_CACHE_DIR=$caches/$dir/triton timeout -k 10 "$seconds" \
      python3 -m dcp_compile.cli demo --device cuda --dcp "$size" --json >> "$OUT/compile.log" 2>&1
    echo "compile $name exit: $? $(date -u +%H:%M:%S)"
  done
}

for what in "$@"; do
  case $what in
    parity) single parity "${PARITY_SECONDS:-420}" python3 -m torch.distributed.run --nproc-per-node "$NPROC" \
              benchmarks/gpu_parity.py --json "$OUT/parity.json" ;;
    suite)  single suite "${SUITE_SECONDS:-150}" python3 -m pytest -q -x -m "not inductor" -p no:cacheprovider tests ;;
    merge)  phase merge "${MERGE_SECONDS:-240}" benchmarks/bench_merge.py --out "$OUT/merge.json" ;;
    e2e)    phase e2e "${E2E_SECONDS:-300}" benchmarks/bench_e2e.py --arms dcp --out "$OUT/e2e_dcp.json" ${E2E_ARGS:-}
            one_gpu_arms "${E2E_ONE_SECONDS:-240}" ;;
    kernel) single kernel "${KERNEL_SECONDS:-240}" python3 benchmarks/bench_kernel.py --out "$OUT/kernel.json" ;;
    demo)   single demo "${DEMO_SECONDS:-150}" python3 -m dcp_compile.cli demo --device cuda --dcp "$NPROC" ;;
    gate)   phase gate "${GATE_SECONDS:-400}" benchmarks/gpu_spec_gate.py --json "$OUT/gate.json" ${GATE_ARGS:-} ;;
    gputests) single gputests "${GPUTESTS_SECONDS:-240}" python3 -m pytest -q -m gpu tests/ops -p no:cacheprovider ;;
    prefillkernels) single prefillkernels "${PREFILLKERNELS_SECONDS:-200}" python3 benchmarks/bench_prefill_kernels.py \
              --json "$OUT/prefill_kernels.json" ;;
    draft)  single draft "${DRAFT_SECONDS:-200}" python3 benchmarks/bench_e2e.py --draft-only --verify-batches 8 \
              --out "$OUT/draft.json" --watchdog $((${DRAFT_SECONDS:-200} - 15)) ;;
    prefill) phase prefill "${PREFILL_SECONDS:-420}" benchmarks/bench_long_prefill.py --phase speed \
              --out "$OUT/prefill_speed.json" ${PREFILL_ARGS:-} ;;
    long)   phase long "${LONG_SECONDS:-560}" benchmarks/bench_long_prefill.py --phase long \
              --out "$OUT/prefill_long.json" ${LONG_ARGS:-} ;;
    specloop) single specloop "${SPECLOOP_SECONDS:-420}" python3 benchmarks/bench_spec_loop.py \
              --out "$OUT/spec_loop.json" --watchdog $((${SPECLOOP_SECONDS:-420} - 15)) ${SPECLOOP_ARGS:-} ;;
    compile) demo_compile_times "${COMPILE_SECONDS:-200}" ;;
    gatebf16) single gatebf16 "${GATE_SECONDS:-300}" python3 -m dcp_compile.cli gate --dcp "$NPROC" --device cuda \
              --dtype bfloat16 --prompts 256 --json ;;
    gatesampled) single gatesampled "${GATE_SECONDS:-300}" python3 -m dcp_compile.cli gate --dcp "$NPROC" --device cuda \
              --dtype bfloat16 --prompts 256 --temperature 0.8 --json ;;
    tpkernel) for heads in 16:1 8:1 32:8; do
                single "k${heads/:/_}" "${TPKERNEL_SECONDS:-110}" python3 benchmarks/bench_kernel.py --heads "$heads" \
                  --contexts 32768 65536 131072 --batches 1 8 --arms ours sdpa copy --fill --out "$OUT/k${heads/:/_}.json"
              done
              single mla "${TPKERNEL_SECONDS:-110}" python3 benchmarks/bench_latent_kernel.py --points 0 1 2 3 4 10 11 \
                --arms ours copy --out "$OUT/mla.json"
              for log in k16_1 k8_1 k32_8 mla; do echo "== $log"; grep -v -i -e warn -e "^{" "$OUT/$log.log" | tail -n 14; done
              continue ;;
    mlasweep) single mlasweep "${MLASWEEP_SECONDS:-300}" python3 benchmarks/bench_latent_kernel.py --sweep \
              --out "$OUT/mla_sweep.json" ;;
    mlakernel) single mlakernel "${MLAKERNEL_SECONDS:-240}" python3 benchmarks/bench_latent_kernel.py \
              --out "$OUT/mla_kernel.json" ${MLAKERNEL_ARGS:-} ;;
    mlagate) phase mlagate "${MLAGATE_SECONDS:-400}" benchmarks/gpu_spec_gate.py --target mla --prompts 512 \
              --max-prompt 512 --max-batch 64 --json "$OUT/mla_gate.json" ${MLAGATE_ARGS:-} ;;
    mlae2e) phase mlae2e "${MLAE2E_SECONDS:-480}" benchmarks/bench_e2e.py --model v2lite --regional \
              --contexts 32768,65536,131072,262144,524288 --batches 8,32 --verify-batches 8,32 --edge 32:262144 \
              --out "$OUT/mla_e2e.json" ${MLAE2E_ARGS:-} ;;
    *) echo "unknown phase $what (parity, suite, merge, e2e, gate, kernel, demo, gputests, prefillkernels,"\
            "draft, prefill, long, specloop, compile, gatebf16, gatesampled, tpkernel, mlasweep, mlakernel, mlagate, mlae2e)"
       exit 2 ;;
  esac
done
for what in "$@"; do
  [ -f "$OUT/$what.log" ] || continue
  echo "== $what: last lines"
  grep -v -i -e warn -e "^{" "$OUT/$what.log" | tail -n 25
done
