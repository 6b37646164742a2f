"""Prefill attention on one GPU: the Triton flash kernels (window and prefix forms)
against PyTorch's SDPA, at Llama-3-8B attention shapes (Hq=32, Hkv=8, D=128, bf16).

    python3 benchmarks/bench_prefill_kernels.py --json $OUT/prefill.json   # one H200, ~30 s
    python3 benchmarks/bench_prefill_kernels.py --small --device cpu       # CPU smoke, Triton interpreter

Two sweeps:

- **window**: causal attention of a chunk of ``T`` new tokens over themselves
  (``T`` in 512..4096, ``B`` in 1, 8).  Arms: ``ours`` (``torch.ops.dcp.window_attention``
  on CUDA: the flash kernel, out fp32 and lse), ``sdpa`` (``F.scaled_dot_product_attention
  (..., is_causal=True, enable_gqa=True)`` on the FLASH backend, no lse).
- **prefix**: a chunk of ``T`` tokens over a local cache of ``S`` slots, all live
  (``S`` in 8K, 32K, 64K).  Arms: ``ours`` (``torch.ops.dcp.prefix_attention``, which
  sends ``T > 16`` to the flash kernel), ``sdpa`` (non-causal SDPA over the same keys,
  ``enable_gqa=True``) and ``sdpa_mask`` (SDPA with an explicit bool mask
  ``[B,1,T,S]``; K/V repeated to ``Hq`` heads beforehand, untimed, since no masked
  backend takes GQA).

Timing: every arm is captured in a CUDA graph of enough calls to run ~1 ms (eager
launches where capture fails, as ``method`` says), warmed up, then timed with CUDA
events: the median of ``--reps`` replays, in ``--rounds`` interleaved rounds (every
arm once per round); the median of the rounds counts.  TFLOP/s counts
``4 * B * Hq * T * S_eff * D`` (``S_eff = T / 2`` for causal: half the scores).
``x_sdpa`` is SDPA's time over the arm's (> 1: faster than SDPA).  A failing arm
prints its error and the sweep goes on; the run starts with a correctness check of
our kernels against the fp32 reference and exits 1 if it fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

from _report import Timer, kilo, short_error, timed_rounds

ROOT = Path(__file__).resolve().parents[1]
WINDOW_TOKENS = (512, 1024, 2048, 4096)
BATCHES = (1, 8)
PREFIX_TOKENS = (512, 2048)
CONTEXTS = (8192, 32768, 65536)
LLAMA3_8B = dict(hq=32, hkv=8, d=128)
SMALL = dict(hq=4, hkv=2, d=16, window_tokens=(40, 70), batches=(1, 2), prefix_tokens=(24,), contexts=(100, 300),
             reps=2, warmup=1, rounds=1)
GRAPH_SECONDS = 1e-3  # one timed replay runs at least this long, so launch gaps vanish
ASSUMED_TFLOPS = 400.0  # only sizes the graphs
CHECK_TOLERANCE = dict(out=3e-2, lse=1e-3)  # bf16 probabilities before the PV product


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu runs our kernels under TRITON_INTERPRET=1 (smoke only, times mean nothing)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (with --device cpu: a smoke run)")
    parser.add_argument("--window-tokens", type=int, nargs="*", default=WINDOW_TOKENS)
    parser.add_argument("--batches", type=int, nargs="*", default=BATCHES)
    parser.add_argument("--prefix-tokens", type=int, nargs="*", default=PREFIX_TOKENS)
    parser.add_argument("--contexts", type=int, nargs="*", default=CONTEXTS)
    parser.add_argument("--arms", nargs="*", default=("ours", "sdpa", "sdpa_mask"))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.small:
        for key in ("window_tokens", "batches", "prefix_tokens", "contexts", "reps", "warmup", "rounds"):
            setattr(args, key, SMALL[key])
    return args


class Bench:
    """Everything that needs torch, imported after TRITON_INTERPRET is settled."""

    def __init__(self, args):
        import torch
        import torch.nn.functional as F
        import triton
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from dcp_compile.ops import attention_with_lse, prefix_flash_triton, window_flash_triton

        self.torch, self.F, self.triton = torch, F, triton
        self.sdpa_kernel, self.backend = sdpa_kernel, SDPBackend
        self.reference = attention_with_lse
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.timer = Timer(self.device, args.reps, args.warmup)
        self.cfg = dict(hq=SMALL["hq"], hkv=SMALL["hkv"], d=SMALL["d"]) if args.small else dict(LLAMA3_8B)
        # On CPU the registered ops are the torch reference: call the kernels directly.
        self.window_op = torch.ops.dcp.window_attention if self.cuda else window_flash_triton
        self.prefix_op = torch.ops.dcp.prefix_attention if self.cuda else prefix_flash_triton

    # -- timing ---------------------------------------------------------------------
    def time_arms(self, arms: dict, flops: float, row: dict) -> None:
        """Prepare every arm (its call repeated in one CUDA graph of about ``GRAPH_SECONDS``
        where it can), then time them in interleaved rounds; results go into ``row``."""
        n = max(1, min(50, math.ceil(GRAPH_SECONDS / (flops / (ASSUMED_TFLOPS * 1e12))))) if self.cuda else 1
        prepared = {}
        for name, make in arms.items():
            if name not in self.args.arms:
                continue
            try:
                run, method = self.timer.prepare([make()] * n)
                prepared[name] = (run, n, method)
            except Exception as exc:  # noqa: BLE001 - one failing arm must not stop the sweep
                row["arms"][name] = dict(error=short_error(exc))
                if self.cuda:
                    self.torch.cuda.synchronize()
        for name, (seconds, rounds) in timed_rounds(prepared, self.timer, self.args.rounds).items():
            row["arms"][name] = dict(ms=seconds * 1e3, tflops=flops / seconds / 1e12, method=prepared[name][2],
                                     round_ms=[r * 1e3 for r in rounds])
        base = row["arms"].get("sdpa", {}).get("ms")
        for arm in row["arms"].values():
            if base and "ms" in arm:
                arm["x_sdpa"] = base / arm["ms"]

    # -- inputs -----------------------------------------------------------------------
    def randn(self, gen, *shape):
        return self.torch.randn(*shape, device=self.device, dtype=self.torch.bfloat16, generator=gen)

    def sdpa(self, *args, **kwargs):
        """SDPA on the FLASH backend on CUDA (torch's choice on CPU)."""
        if not self.cuda:
            return self.F.scaled_dot_product_attention(*args, **kwargs)
        with self.sdpa_kernel(self.backend.FLASH_ATTENTION):
            return self.F.scaled_dot_product_attention(*args, **kwargs)

    # -- correctness ------------------------------------------------------------------
    def check(self) -> bool:
        """Both kernels through the ops against the fp32 reference, NaN past kv_len."""
        torch = self.torch
        hq, hkv, d = self.cfg["hq"], self.cfg["hkv"], self.cfg["d"]
        gen = torch.Generator(device=self.device).manual_seed(0)
        T, S = (300, 1000) if self.cuda else (40, 90)
        q = self.randn(gen, 3, hq, T, d)
        k, v = self.randn(gen, 3, hkv, S, d), self.randn(gen, 3, hkv, S, d)
        kv_len = torch.tensor([0, S, S * 3 // 4 + 5], device=self.device)
        slots = torch.arange(S, device=self.device)
        unused = (slots[None, :] >= kv_len[:, None])[:, None, :, None]
        got = self.prefix_op(q, k.masked_fill(unused, float("nan")), v.masked_fill(unused, float("nan")), kv_len,
                             d**-0.5)
        want = self.reference(q, k, v, (slots[None, :] < kv_len[:, None])[:, None, :], d**-0.5)
        ok = self._report_check("prefix", got, want)
        positions = torch.stack([torch.arange(S, device=self.device) + 7, torch.randperm(S, device=self.device),
                                 torch.arange(S, device=self.device)])
        qw = self.randn(gen, 3, hq, S, d)
        got = self.window_op(qw, k, v, positions, d**-0.5)
        want = self.reference(qw, k, v, positions[:, None, :] <= positions[:, :, None], d**-0.5)
        return self._report_check("window", got, want) and ok

    def _report_check(self, form, got, want) -> bool:
        (out, lse), (ref_out, ref_lse) = got, want
        finite = self.torch.isfinite(ref_lse)
        out_err = (out - ref_out).abs().max().item()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        empty_ok = bool((lse[~finite] == float("-inf")).all() and (out.masked_fill(finite[..., None], 0) == 0).all())
        good = (out_err <= CHECK_TOLERANCE["out"] and lse_err <= CHECK_TOLERANCE["lse"] and empty_ok
                and not self.torch.isnan(out).any().item())
        print(f"check {form}: max |out - ref| {out_err:.2e} (tol {CHECK_TOLERANCE['out']}), max |lse - ref| "
              f"{lse_err:.2e} (tol {CHECK_TOLERANCE['lse']}), empty rows 0/-inf: {empty_ok} -> "
              f"{'ok' if good else 'WRONG'}", flush=True)
        return good

    # -- the sweeps -------------------------------------------------------------------
    def window_row(self, batch: int, tokens: int) -> dict:
        torch = self.torch
        hq, hkv, d = self.cfg["hq"], self.cfg["hkv"], self.cfg["d"]
        gen = torch.Generator(device=self.device).manual_seed(batch * 100003 + tokens)
        q = self.randn(gen, batch, hq, tokens, d)
        k, v = self.randn(gen, batch, hkv, tokens, d), self.randn(gen, batch, hkv, tokens, d)
        positions = torch.arange(tokens, device=self.device).expand(batch, tokens).contiguous()
        scale = d**-0.5
        flops = 4 * batch * hq * tokens * tokens * d / 2
        row = dict(form="window", batch=batch, t=tokens, s=tokens, causal=True, flops=flops, arms={})
        ours_out, _ = self.window_op(q, k, v, positions, scale)
        ref = self.sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        row["ours_vs_sdpa_max_abs"] = (ours_out - ref.float()).abs().max().item()
        arms = {
            "ours": lambda: lambda: self.window_op(q, k, v, positions, scale),
            "sdpa": lambda: lambda: self.sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        }
        self.time_arms(arms, flops, row)
        return row

    def prefix_row(self, batch: int, tokens: int, context: int) -> dict:
        torch = self.torch
        hq, hkv, d = self.cfg["hq"], self.cfg["hkv"], self.cfg["d"]
        gen = torch.Generator(device=self.device).manual_seed(batch * 1000003 + tokens * 7 + context)
        q = self.randn(gen, batch, hq, tokens, d)
        k, v = self.randn(gen, batch, hkv, context, d), self.randn(gen, batch, hkv, context, d)
        kv_len = torch.full((batch,), context, device=self.device, dtype=torch.int64)
        scale = d**-0.5
        flops = 4 * batch * hq * tokens * context * d
        row = dict(form="prefix", batch=batch, t=tokens, s=context, causal=False, flops=flops, arms={})
        ours_out, _ = self.prefix_op(q, k, v, kv_len, scale)
        ref = self.sdpa(q, k, v, scale=scale, enable_gqa=True)
        row["ours_vs_sdpa_max_abs"] = (ours_out - ref.float()).abs().max().item()
        del ours_out, ref

        def masked():
            group = hq // hkv
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            live = torch.arange(context, device=self.device)[None, :] < kv_len[:, None]
            mask = live[:, None, None, :].expand(batch, 1, tokens, context)
            return lambda: self.F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=scale)

        arms = {
            "ours": lambda: lambda: self.prefix_op(q, k, v, kv_len, scale),
            "sdpa": lambda: lambda: self.sdpa(q, k, v, scale=scale, enable_gqa=True),
            "sdpa_mask": masked,
        }
        self.time_arms(arms, flops, row)
        return row


def table(rows) -> str:
    names = ("ours", "sdpa", "sdpa_mask")
    head = "| form | B | T | S | " + " | ".join(f"{n} ms | {n} TFLOP/s" for n in names) + " | ours x SDPA |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for n in names:
            arm = r["arms"].get(n, {})
            if "ms" in arm:
                cells += [f"{arm['ms']:.3f}", f"{arm['tflops']:.0f}"]
            else:
                cells += ["fail" if "error" in arm else "-", "-"]
        ratio = r["arms"].get("ours", {}).get("x_sdpa")
        ratio = f"{ratio:.2f}" if ratio else "-"
        lines.append(f"| {r['form']} | {r['batch']} | {r['t']} | {kilo(r['s'])} | " + " | ".join(cells)
                     + f" | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Read when triton is imported, so set before anything imports it.
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.ops.triton_interpret import patch_interpreter

        patch_interpreter()
    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --small --device cpu for the interpreter smoke run",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    bench = Bench(args)
    from dcp_compile.ops import triton_flash

    gpu = torch.cuda.get_device_name() if bench.cuda else "cpu (Triton interpreter)"
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), gpu=gpu,
        torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        command="python3 " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        config=dict(bench.cfg, dtype="bfloat16"),
        kernel={form: dict(zip(("block_m", "block_n", "num_warps", "num_stages"),
                               triton_flash.flash_config(bench.cfg["d"], 2, window=form == "window")))
                for form in ("window", "prefix")},
        conventions=dict(tflops="4*B*Hq*T*S_eff*D / time; causal S_eff = T/2",
                         x_sdpa="SDPA ms / arm ms (> 1: faster than SDPA)",
                         timing="median over rounds of the median of CUDA-event timed graph replays"),
    )
    print(f"{gpu}; torch {env['torch']}; triton {env['triton']}; python {env['python']}")
    print(f"command: {env['command']}")
    print(f"kernel tiles for D={bench.cfg['d']} bf16: {env['kernel']}", flush=True)
    if not bench.check():
        print("our kernels disagree with the reference: no timings", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(env=env, correct=False), indent=1))
        return 1

    rows = []
    plan = [("window", b, t, t) for b in args.batches for t in args.window_tokens]
    plan += [("prefix", b, t, s) for b in args.batches for t in args.prefix_tokens for s in args.contexts]
    for form, batch, tokens, context in plan:
        try:
            row = bench.window_row(batch, tokens) if form == "window" else bench.prefix_row(batch, tokens, context)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at one point
            row = dict(form=form, batch=batch, t=tokens, s=context, error=short_error(exc), arms={})
        rows.append(row)
        summary = ", ".join(f"{n} {a['ms']:.3f} ms {a['tflops']:.0f} TFLOP/s" if "ms" in a else f"{n} {a['error']}"
                            for n, a in row["arms"].items()) or row.get("error", "")
        print(f"{form} B={batch} T={tokens} S={context}: {summary}  [{time.monotonic() - started:.0f}s]", flush=True)
        if bench.cuda:
            torch.cuda.empty_cache()
    print()
    print("TFLOP/s = 4*B*Hq*T*S_eff*D / time (causal: S_eff = T/2); ours x SDPA = SDPA ms / ours ms.")
    print(table(rows))
    env["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(env=env, correct=True, rows=rows), indent=1))
        print(f"\nwrote {args.json} ({env['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
