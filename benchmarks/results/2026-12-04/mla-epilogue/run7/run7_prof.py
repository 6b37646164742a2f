"""Kernel times of the seesaw op's merge forms at the two points under 400 TFLOP/s (torch.profiler)."""
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dcp_compile.ops import gluon_latent

out = {}
for B, H, T, S in ((8, 128, 1, 8192), (8, 16, 4, 32768), (8, 128, 1, 32768)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    caches = [(torch.randn(B, 1, S, 512, device="cuda", dtype=torch.bfloat16, generator=gen),
               torch.randn(B, 1, S, 64, device="cuda", dtype=torch.bfloat16, generator=gen)) for _ in range(4)]
    kv_len = torch.full((B,), S, device="cuda")
    for name, options in (("merge-kernel", dict(merge="kernel")), ("fused", {}), ("fused-zeroed", dict(kept_counts=False))):
        def run():
            for lat, pe in caches:
                gluon_latent.seesaw_attention(q, lat, pe, kv_len, 0.07, **options)
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                run()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        for e in events:
            times[e.name[:40]].append(e.time_range.end - e.time_range.start)
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])]
        gaps.sort()
        summary = {k: dict(n=len(v), median_us=sorted(v)[len(v) // 2]) for k, v in times.items()}
        median_gap = gaps[len(gaps) // 2] if gaps else None
        print(f"B={B} H={H} T={T} S={S} {name}: {summary}; median gap {median_gap} us", flush=True)
        out[f"{B}-{H}-{T}-{S}-{name}"] = dict(kernels=summary, median_gap_us=median_gap)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "profile.json"), "w"), indent=1)
