"""A Hugging Face Llama-3-8B-shaped model under DCP=2: bf16 decode parity, and decode
step time against DCP=1.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_hf.py
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_hf.py --small   # same path, CPU, gloo

The model is ``transformers.LlamaForCausalLM`` (32 layers, hidden 4096, 32/8 heads,
intermediate 14336, vocab 128256), random init, bf16, identical on both ranks, driven
by the loop HF users write (``model(input_ids, past_key_values=cache)``) with
``dcp_compile.hf.DCPStaticCache``.

**Parity** (batch 1, a ~1K-token prompt, 16 greedy decode steps).  The DCP=2 arm
generates; every reference is fed the same tokens (teacher forcing), so a near-tie
cannot derail the comparison:
- ``bf16``: the unsharded model, eager, HF's own ``StaticCache``;
- ``dcp1``: the unsharded model compiled with the size-1 backend (the off arm);
- ``fp32``: an fp32 copy of the unsharded model, eager: the yardstick for how far bf16
  itself is from exact.
Reported: max / mean |logit difference| per pair and argmax agreement with the DCP arm.

**Step time.**  For each context and batch, a cache filled with random K/V up to that
context, one decode step (T = 1) captured in a CUDA graph (collectives included),
median of CUDA-event timed replays, DCP=2 against DCP=1 (each rank runs DCP=1 alone).

``--family deepseek-v2-lite``: ``transformers.DeepseekV2ForCausalLM`` with DeepSeek-V2-Lite's
attention (27 layers, hidden 2048, 16 heads, kv_lora 512, rope 64, nope 128, values 128,
no query LoRA), every layer's MLP dense (intermediate 10944, about 2.4B parameters with the
embeddings) in place of the MoE, vocab 102400: transformers' own multi-head latent attention,
which caches the latent and expands every cached slot by ``kv_b_proj`` at each step.

``--one-gpu``: one GPU, no parity run; the step time of a size-1 group compiled with the
cascade (``cascade=True``: the prefix and window Triton kernels and the merge, what each
rank of a DCP group runs, without the collective) against plain ``torch.compile`` of the
same model and cache, on identical cache contents, and how far their logits are apart.

    python3 benchmarks/gpu_hf.py --family deepseek-v2-lite --one-gpu --lowering inductor

The last line is the JSON report.  The script leaves with ``os._exit`` once it has
printed: NCCL teardown at exit has hung on these machines.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.hf import DCPStaticCache, cache_kwarg
from dcp_compile.group import DCPGroup
from dcp_compile.runtime.cuda_graphs import capture

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
DEEPSEEK_V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=27)
SMALL_DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                      qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2)
FAMILIES = {"llama3-8b": ("LlamaConfig", "LlamaForCausalLM", LLAMA3_8B, SMALL),
            "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_V2_LITE, SMALL_DEEPSEEK)}


def build_model(family: str, small: bool, group: DCPGroup, dtype: torch.dtype, layers: int | None = None):
    """A random-init transformers model of ``family``'s shapes (``layers``: fewer decoder layers)."""
    import transformers

    config_class, model_class, shapes, small_shapes = FAMILIES[family]
    shapes = dict(small_shapes if small else shapes)
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    config = getattr(transformers, config_class)(**shapes, max_position_embeddings=1 << 17,
                                                 attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(group.device):
            model = getattr(transformers, model_class)(config).eval()
    finally:
        torch.set_default_dtype(default)
    if group.size > 1:  # the same weights on every rank, whatever the RNG did
        for p in model.parameters():
            dist.broadcast(p.data, 0, group=group.process_group)
    return model


@torch.no_grad()
def teacher_forced(forward, prompt: torch.Tensor, tokens: torch.Tensor, cache_kwargs: dict) -> torch.Tensor:
    """Logits ``[steps + 1, V]`` (fp32) after the prompt and after each of ``tokens[:-1]``."""
    out = [forward(input_ids=prompt, **cache_kwargs).logits[0, -1].float()]
    for token in tokens[:-1]:
        out.append(forward(input_ids=token.view(1, 1), **cache_kwargs).logits[0, -1].float())
    return torch.stack(out)


@torch.no_grad()
def parity(model, group: DCPGroup, prompt_len: int, steps: int, lowering: str) -> dict:
    from transformers import StaticCache

    kwarg, device = cache_kwarg(model), group.device
    capacity = prompt_len + steps + 1
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    if group.size > 1:
        dist.broadcast(prompt, 0, group=group.process_group)

    torch._dynamo.reset()
    start = time.perf_counter()
    model_c = torch.compile(model, backend=dcp.backend(group, lowering=lowering), fullgraph=True, dynamic=False)
    cache = DCPStaticCache(model.config, group, max_batch_size=1, max_cache_len=capacity, dtype=model.dtype, device=device)
    logits, tokens = [], []
    ids = prompt
    for _ in range(steps + 1):
        last = model_c(input_ids=ids, **{kwarg: cache}).logits[0, -1].float()
        logits.append(last)
        tokens.append(last.argmax())
        ids = tokens[-1].view(1, 1)
    dcp_logits, tokens = torch.stack(logits), torch.stack(tokens)
    dcp_seconds = time.perf_counter() - start
    del cache

    arms = {"bf16": teacher_forced(model, prompt, tokens, {kwarg: StaticCache(config=model.config, max_cache_len=capacity)})}
    torch._dynamo.reset()
    off = DCPGroup(1, group.rank, device, None)
    off_c = torch.compile(model, backend=dcp.backend(off, lowering=lowering), fullgraph=True, dynamic=False)
    off_cache = DCPStaticCache(model.config, off, max_batch_size=1, max_cache_len=capacity, dtype=model.dtype, device=device)
    arms["dcp1"] = teacher_forced(off_c, prompt, tokens, {kwarg: off_cache})
    del off_cache
    fp32 = copy.deepcopy(model).float()
    arms["fp32"] = teacher_forced(fp32, prompt, tokens, {kwarg: StaticCache(config=fp32.config, max_cache_len=capacity)})
    del fp32
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def diff(a, b):
        d = (a.double() - b.double()).abs()
        return dict(max=float(d.max()), mean=float(d.mean()))

    return dict(
        prompt_len=prompt_len, steps=steps, dcp2_seconds_with_compile=round(dcp_seconds, 1),
        dcp2_vs_bf16=diff(dcp_logits, arms["bf16"]), dcp2_vs_fp32=diff(dcp_logits, arms["fp32"]),
        bf16_vs_fp32=diff(arms["bf16"], arms["fp32"]), dcp1_vs_bf16=diff(arms["dcp1"], arms["bf16"]),
        dcp2_vs_dcp1=diff(dcp_logits, arms["dcp1"]),
        argmax_agreement={name: float((a.argmax(-1) == tokens).double().mean()) for name, a in arms.items()},
    )


@torch.no_grad()
def step_time(model, group: DCPGroup, context: int, batch: int, lowering: str, replays: int,
              cascade: bool = False) -> tuple[float, torch.Tensor, int]:
    """Median seconds of one decode step with ``context`` tokens cached per sequence, the
    step's last logits (the cache holds the same random contents for a rank whatever the
    group and arm), and the prefix-attention ops the passes put in the step's graph (one a
    rewritten attention; none where the graph compiles plainly)."""
    device, kwarg = group.device, cache_kwarg(model)
    torch._dynamo.reset()
    cache = DCPStaticCache(model.config, group, max_batch_size=batch, max_cache_len=context + 2 * replays + 8,
                           dtype=model.dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(2 + group.rank)
    for name, buffer in cache.store.named_buffers():
        buffer.normal_(generator=gen)
    cache.length.fill_(context)
    # The replays stay inside the cache (max_cache_len above), so the host-side positions
    # check, which a capture refuses, is off.
    backend = dcp.backend(group, lowering=lowering, cascade=cascade, check_positions=False)
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def step():
        return model_c(input_ids=ids, **{kwarg: cache}).logits

    logits = step()[:, -1].float().clone()  # compiles; the first step on the filled cache
    sites = sum("dcp.prefix_attention" in str(node.target)
                for compiled in backend.compiled for node in compiled.graph_module.graph.nodes)
    if device.type != "cuda":
        times = []
        for _ in range(replays):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times), logits, sites
    graph, _ = capture(step)
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    del graph, cache
    torch.cuda.empty_cache()
    return statistics.median(times), logits, sites


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU with gloo: the same code path")
    parser.add_argument("--lowering", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama3-8b")
    parser.add_argument("--one-gpu", action="store_true",
                        help="one GPU: a size-1 group with the cascade against plain torch.compile, no parity run")
    args = parser.parse_args()
    if args.small:
        args.prompt_len, args.steps, args.contexts, args.batches, args.replays = 40, 4, "64,128", "1,2", 3
    if args.one_gpu:
        group = DCPGroup(1, 0, torch.device("cpu") if args.small else torch.device("cuda", 0), None)
    else:
        group = dcp.init_group("cpu" if args.small else None)
    say = print if group.rank == 0 else (lambda *a, **k: None)
    dtype = torch.float32 if args.small else torch.bfloat16
    model = build_model(args.family, args.small, group, dtype)
    import transformers

    launcher = [] if args.one_gpu else ["-m torch.distributed.run --nproc-per-node", str(group.size)]
    report = dict(
        dcp_size=group.size, gpu=torch.cuda.get_device_name(group.device) if group.device.type == "cuda" else "cpu",
        torch=torch.__version__, transformers=transformers.__version__, lowering=args.lowering, dtype=str(dtype),
        family=args.family, command=" ".join([os.path.basename(sys.executable), *launcher, *sys.argv]),
    )
    start = time.perf_counter()
    if not args.one_gpu:
        report["parity"] = parity(model, group, args.prompt_len, args.steps, args.lowering)
        say(json.dumps(report["parity"], indent=1), flush=True)
    rows = []
    off = DCPGroup(1, group.rank, group.device, None)
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            if args.one_gpu:
                cascade, cascade_logits, sites = step_time(model, off, context, batch, args.lowering, args.replays,
                                                           cascade=True)
                plain, plain_logits, plain_sites = step_time(model, off, context, batch, args.lowering, args.replays)
                gap = float((cascade_logits - plain_logits).abs().max())
                agree = float((cascade_logits.argmax(-1) == plain_logits.argmax(-1)).double().mean())
                rows.append(dict(context=context, batch=batch, cascade_ms=round(1e3 * cascade, 3),
                                 plain_ms=round(1e3 * plain, 3), ratio=round(cascade / plain, 3),
                                 max_logit_gap=gap, argmax_agreement=agree, cascade_sites=sites,
                                 plain_sites=plain_sites))
                say(f"context {context:>6}  batch {batch}  cascade {1e3 * cascade:8.3f} ms  plain torch.compile "
                    f"{1e3 * plain:8.3f} ms  ratio {cascade / plain:.3f}  max |logit gap| {gap:.3g}  argmax agree "
                    f"{agree:.2f}", flush=True)
                continue
            dcp2, _, _ = step_time(model, group, context, batch, args.lowering, args.replays)
            dcp1, _, _ = step_time(model, off, context, batch, args.lowering, args.replays)
            rows.append(dict(context=context, batch=batch, dcp2_ms=round(1e3 * dcp2, 3), dcp1_ms=round(1e3 * dcp1, 3),
                             ratio=round(dcp2 / dcp1, 3)))
            say(f"context {context:>6}  batch {batch}  DCP=2 {1e3 * dcp2:8.3f} ms  DCP=1 {1e3 * dcp1:8.3f} ms  "
                f"ratio {dcp2 / dcp1:.3f}", flush=True)
    report["step_time"] = rows
    report["seconds"] = round(time.perf_counter() - start, 1)
    say(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
