"""Cold and warm compile of the demo's decoder, each arm in a fresh process.

    python3 benchmarks/bench_compile.py --out $OUT/compile.json            # one GPU
    python3 benchmarks/bench_compile.py --device cpu --max-new-tokens 4     # the script itself, on CPU
    python3 benchmarks/bench_compile.py --profile $OUT/profiles ...         # + where a warm restart spends it

What a server restart pays before its first token: the demo's models (``--model``,
default the embedded tiny-code pair) in a ``SpecDecoder`` on a group of one, timed from
the decoder's first call (``generate_all`` of ``k + 2`` tokens: every graph compiled and,
on a GPU, captured) to its return.  Arms, each in a process of its own:

- **dcp**: the target's prefill and verify rewritten into the cascade DCP runs (prefix over
  the cache, window, merge: ``dcp.backend(..., cascade=True)`` on a group of one, every
  DCP rank's kernels without the collective), the draft as always;
- **dcp-opaque**: the same, with the attention ops left opaque to Inductor
  (``dcp.backend(..., kernels="opaque")``, ``ops.inlining``) in the target and the draft;
- **off**: the demo's off arm: a group of one, whose target compiles as plain
  ``torch.compile`` does (the passes leave it alone).

Each runs **cold** (empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` of its own)
and then **warm** (a second fresh process on the caches the cold one filled: a restart).
The child reports the import, the model build, the compile call and its split
(``arms.compile_breakdown``: analysis, passes, lowering, the rest), and the tokens, which
must equal between an arm's cold and warm runs (the two arms round differently in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()
ARMS = ("dcp", "dcp-opaque", "off")


def child(args) -> dict:
    import torch

    imported = time.perf_counter() - START
    from dcp_compile import cli
    from dcp_compile.commands import arms, loading
    from dcp_compile.group import DCPGroup
    from dcp_compile.runtime import spec

    if args.arm.startswith("dcp"):
        made = spec.make_backend
        kernels = "opaque" if args.arm == "dcp-opaque" else "inline"

        def cascade_backend(group, role, **kw):
            return made(group, role, cascade=role == "target", **dict(kw, kernels=kernels))

        spec.make_backend = cascade_backend
    parser = cli._parser()
    demo = parser.parse_args(["demo", "--device", args.device, "--model", args.model,
                              "--max-new-tokens", str(args.max_new_tokens)])
    demo.spec = loading.resolve(demo.model, demo.draft)
    cli._check_tree(parser, demo, demo.spec.speculative)
    demo.lowering = args.lowering
    demo.codec = loading.codec(demo.spec)
    device = torch.device(args.device)
    prompts = [demo.codec.encode(p) for p in arms.DEMO_PROMPTS]
    started = time.perf_counter()
    result = arms._run_arm(args.arm, DCPGroup(1, 0, device, None), demo, prompts, talk=False)
    total = time.perf_counter() - started
    from torch._dynamo.utils import counters

    caches = {f"{group}.{name}": count for group in ("inductor", "aot_autograd") for name, count in counters[group].items()
              if "cache" in name}
    return dict(arm=args.arm, import_s=imported, build_and_compile_s=total, compile_s=result["compile_s"], caches=caches,
                compile_breakdown=result["compile_breakdown"], tokens=[o.tokens for o in result["outputs"]],
                tokens_per_s=result["tokens_per_s"], process_s=time.perf_counter() - START)


def profiled_child(args) -> dict:
    """``child`` under cProfile, its top functions written to ``args.profile_child``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    result = profiler.runcall(child, args)
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(60)
    with open(args.profile_child, "w") as f:
        f.write(f"{args.arm}, warm, under cProfile: compile {result['compile_s']:.1f} s\n{text.getvalue()}")
    return result


def run_child(arm: str, caches: str, args, profile: str | None = None) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    command = [sys.executable, __file__, "--child", arm, "--device", args.device, "--model", args.model,
               "--max-new-tokens", str(args.max_new_tokens), "--lowering", args.lowering]
    command += ["--profile-child", profile] if profile else []
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{arm} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="tiny-code")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    parser.add_argument("--out")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--profile", metavar="DIR",
                        help="after each arm's warm run, a third run on the same caches under cProfile: its "
                             "functions by own and by cumulative time in DIR/<arm>-warm.txt (not timed)")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.arm = args.child
        print(json.dumps((profiled_child if args.profile_child else child)(args)), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory() as root:
        for arm in args.arms:
            caches = os.path.join(root, arm)
            for phase in ("cold", "warm"):
                result = run_child(arm, caches, args)
                result["phase"] = phase
                runs.append(result)
                print(f"[{time.strftime('%H:%M:%S')}] {arm} {phase}: compile {result['compile_s']:.1f} s, "
                      f"{result['compile_breakdown']}", file=sys.stderr, flush=True)
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                run_child(arm, caches, args, profile=os.path.join(args.profile, f"{arm}-warm.txt"))
    by = {(r["arm"], r["phase"]): r for r in runs}
    same = all(by[arm, "cold"]["tokens"] == by[arm, "warm"]["tokens"] for arm in args.arms)
    summary = dict(runs=runs, cold_and_warm_tokens_identical=same,
                   **{f"cold_ratio_{arm}_to_off": by[arm, "cold"]["compile_s"] / by["off", "cold"]["compile_s"]
                      for arm in args.arms if arm != "off" and "off" in args.arms})
    try:
        import torch
        import triton

        summary["env"] = dict(torch=torch.__version__, triton=triton.__version__,
                              device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    except ImportError:
        pass
    print("| arm | phase | import s | compile s | analysis | passes | lowering | rest | graphs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        b = r["compile_breakdown"]
        print(f"| {r['arm']} | {r['phase']} | {r['import_s']:.1f} | {r['compile_s']:.1f} | {b['analysis']:.2f} | "
              f"{b['passes']:.2f} | {b['lowering']:.1f} | {b['rest']:.1f} | {b['graphs']} |")
    for r in runs:
        print(f"{r['arm']} {r['phase']} caches: {r['caches']}")
    ratios = ", ".join(f"{key}: {value:.2f}" for key, value in summary.items() if key.startswith("cold_ratio"))
    print(f"{ratios}; each arm's cold and warm tokens identical: {same}")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
