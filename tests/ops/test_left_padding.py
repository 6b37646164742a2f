"""The left-padding bound on the length-bounded attention kernels, against float64.

A left-padding mask is a per-row lower bound on the key positions: the prefix reads
local slots ``[kv_start[b], kv_len[b])``, the window the new keys at positions
``>= lower[b]``.  Every case poisons what the bound hides with NaN (pad slots and pad
keys, and the prefix's slots past ``kv_len``) while the reference reads clean copies,
so a leak shows up as NaN or as a mismatch.  The rows cover no padding, only padding,
only padding and one token, and pads longer than a chunk (several key blocks and query
tiles).  The CPU blocked kernels (the ops' default kernels) run here; the Triton
kernels (split-KV, flash prefix, flash window) run under Triton's interpreter in one
spawned process, and for real with ``pytest -m gpu``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_compile.ops.attention  # noqa: F401  (registers the dcp:: ops)
from tests.ops.test_attention import attention_float64

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import sys, torch
from tests.ops.triton_interpret import patch_interpreter
patch_interpreter()
import dcp_compile.ops
cases = torch.load(sys.argv[1])
torch.save({name: getattr(dcp_compile.ops, op)(**args) for name, (op, args) in cases.items()}, sys.argv[2])
"""
SCALE = 0.3
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # fp32 throughout: the kernels' ieee dots and the blocked reference
SMALL = dict(block_m=16, block_n=16)


def prefix_case(seed, *, t, kv_len, kv_start, s=70, hq=4, hkv=2, d=16):
    """Prefix arguments with NaN in the slots before ``kv_start`` and from ``kv_len`` on,
    the clean keys and values, and the allowed mask ``[B, T, S]``."""
    gen = torch.Generator().manual_seed(seed)
    b = len(kv_len)
    q = torch.randn(b, hq, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, s, d, generator=gen) for _ in range(2))
    lengths, starts = torch.tensor(kv_len), torch.tensor(kv_start)
    slots = torch.arange(s)[None, :]
    seen = (slots < lengths[:, None]) & (slots >= starts[:, None])
    hidden = ~seen[:, None, :, None]
    args = dict(q=q, k_cache=k.masked_fill(hidden, float("nan")), v_cache=v.masked_fill(hidden, float("nan")),
                kv_len=lengths, scale=SCALE, kv_start=starts)
    return args, (k, v), seen[:, None, :].expand(b, t, s)


def window_case(seed, *, positions, lower, hq=4, hkv=2, d=16):
    """Window arguments for new tokens at ``positions [B, T]`` with NaN in the keys and
    values below each row's ``lower``, the clean ones, and the allowed mask ``[B, T, T]``."""
    gen = torch.Generator().manual_seed(seed)
    positions, lower = torch.as_tensor(positions), torch.tensor(lower)
    b, t = positions.shape
    q = torch.randn(b, hq, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, t, d, generator=gen) for _ in range(2))
    pad = positions < lower[:, None]
    args = dict(q=q, k_new=k.masked_fill(pad[:, None, :, None], float("nan")),
                v_new=v.masked_fill(pad[:, None, :, None], float("nan")), positions=positions, scale=SCALE, lower=lower)
    allowed = (positions[:, None, :] <= positions[:, :, None]) & ~pad[:, None, :]
    return args, (k, v), allowed


def chunk(start, t, rows):
    """Positions ``start .. start + t - 1`` in every row: a prefill chunk."""
    return (start + torch.arange(t)).expand(rows, t).contiguous()


# Rows: no padding, only padding and one token, only padding, pads longer than a chunk
# (and a bound past the length, which clamps to nothing).
PREFIX = {
    "decode": dict(t=1, kv_len=(70, 40, 40, 70, 20), kv_start=(0, 39, 40, 55, 33)),
    "verify": dict(t=5, kv_len=(70, 40, 40, 70, 20), kv_start=(0, 39, 40, 55, 33)),
    "chunk": dict(t=37, kv_len=(70, 40, 40, 70, 20), kv_start=(0, 39, 40, 55, 33)),
    "long pads": dict(t=16, s=300, kv_len=(300, 290, 17), kv_start=(0, 260, 16)),
}
WINDOW = {
    # a chunk of 40 tokens at 10..49: pads end before it, inside it, at its last token,
    # past it, and one row whose pads cover a whole earlier chunk
    "chunk": dict(positions=chunk(10, 40, 5), lower=(0, 23, 49, 50, 10)),
    "decode": dict(positions=chunk(30, 1, 3), lower=(0, 30, 31)),
    # positions out of order (a tree or a shuffled chunk): pads anywhere in the window
    "shuffled": dict(positions=torch.randperm(40, generator=torch.Generator().manual_seed(0)).expand(3, 40),
                     lower=(0, 17, 39)),
}
PREFIX_CASES = {name: prefix_case(i, **spec) for i, (name, spec) in enumerate(PREFIX.items())}
WINDOW_CASES = {name: window_case(10 + i, **spec) for i, (name, spec) in enumerate(WINDOW.items())}


def assert_matches(out, lse, args, clean, allowed):
    q = args["q"]
    ref_out, ref_lse = attention_float64(q, *clean, allowed, SCALE)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "a padded or unused slot leaked"
    empty = ~allowed.any(-1)[:, None, :].expand_as(lse)
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all(), "a row of only padding sees nothing"
    torch.testing.assert_close(out.double()[~empty], ref_out[~empty], **TOLERANCE)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], **TOLERANCE)


@pytest.mark.parametrize("name", PREFIX)
def test_cpu_prefix_kernel_reads_from_the_bound(name):
    args, clean, allowed = PREFIX_CASES[name]
    out, lse = torch.ops.dcp.prefix_attention(**args)
    assert_matches(out, lse, args, clean, allowed)


@pytest.mark.parametrize("name", WINDOW)
def test_cpu_window_kernel_reads_from_the_bound(name):
    args, clean, allowed = WINDOW_CASES[name]
    out, lse = torch.ops.dcp.window_attention(**args)
    assert_matches(out, lse, args, clean, allowed)


def test_cpu_prefix_kernel_skips_key_blocks_below_every_bound():
    """Pads longer than a key block: the blocks below the batch's smallest bound are not
    visited at all (their slots hold NaN, and the result is the same as over the
    visible slots alone)."""
    from dcp_compile.ops.attention import prefix_attention_reference

    from dcp_compile.ops import attention

    args, clean, allowed = prefix_case(5, t=3, s=64, kv_len=(64, 60), kv_start=(40, 33))
    visited = []
    original = attention.attention_with_lse

    def spy(q, k, v, allowed_tile, scale):
        visited.append(k.shape[2])
        return original(q, k, v, allowed_tile, scale)

    attention.attention_with_lse = spy
    try:
        out, lse = prefix_attention_reference(args["q"], args["k_cache"], args["v_cache"], args["kv_len"], SCALE,
                                              args["kv_start"])
    finally:
        attention.attention_with_lse = original
    assert_matches(out, lse, args, clean, allowed)
    assert sum(visited) == 64 - 33, "the key blocks start at the smallest bound"


@pytest.mark.parametrize("size,interleave", [(1, 1), (2, 1), (3, 2)])
def test_ranks_together_read_each_visible_position_once(size, interleave):
    """Over the ranks of a group, local slots ``[prefix_starts(lower), kv_len)`` hold
    exactly the global positions ``[lower, start)`` of each row, each on one rank."""
    from dcp_compile.layout import KVLayout
    from dcp_compile.ops.cascade import prefix_lengths, prefix_starts

    S = 30
    starts = torch.tensor([0, 7, 19, 29, 12])
    lower = torch.tensor([0, 3, 19, 40, -2])  # no padding, some, all but none, past the cache, below 0
    positions = starts[:, None] + torch.arange(1)
    seen = torch.zeros(len(starts), S, dtype=torch.long)
    for rank in range(size):
        layout = KVLayout(size, rank, S, interleave)
        sharding = dict(size=size, rank=rank, interleave=interleave, max_seq_len=S)
        first, end = prefix_starts(lower, **sharding), prefix_lengths(positions, **sharding)
        for b in range(len(starts)):
            for slot in range(int(first[b]), int(end[b])):
                seen[b, layout.global_position(slot)] += 1
    expected = (torch.arange(S)[None, :] >= lower[:, None]) & (torch.arange(S)[None, :] < starts[:, None])
    assert torch.equal(seen, expected.long())


def _triton_cases():
    """Name -> ``(op, arguments, (clean k/v, allowed))``."""
    cases = {}
    for name, (args, clean, allowed) in PREFIX_CASES.items():
        if args["q"].shape[2] <= 16:  # the split-KV kernel serves decode and verify steps
            cases[f"split {name}"] = ("prefix_attention_triton", dict(args, num_splits=3, block_s=16), clean, allowed)
        cases[f"flash prefix {name}"] = ("prefix_flash_triton", dict(args, **SMALL), clean, allowed)
    for name, (args, clean, allowed) in WINDOW_CASES.items():
        cases[f"flash window {name}"] = ("window_flash_triton", dict(args, **SMALL), clean, allowed)
    # the tiles a GPU gets (64-key blocks, 128 query rows): pads cross whole blocks
    args, clean, allowed = WINDOW_CASES["chunk"]
    cases["flash window default tiles"] = ("window_flash_triton", args, clean, allowed)
    args, clean, allowed = PREFIX_CASES["long pads"]
    cases["flash prefix default tiles"] = ("prefix_flash_triton", args, clean, allowed)
    return cases


TRITON_CASES = _triton_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("left_padding")
    torch.save({name: (op, args) for name, (op, args, _, _) in TRITON_CASES.items()}, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder / "cases.pt"), str(folder / "results.pt")],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_kernels_read_from_the_bound(interpreted, name):
    _, args, clean, allowed = TRITON_CASES[name]
    out, lse = interpreted[name]
    assert_matches(out, lse, args, clean, allowed)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_kernels_read_from_the_bound_on_gpu(name):
    import dcp_compile.ops

    op, args, clean, allowed = TRITON_CASES[name]
    cuda_args = {key: a.cuda() if isinstance(a, torch.Tensor) else a for key, a in args.items()}
    out, lse = (x.cpu() for x in getattr(dcp_compile.ops, op)(**cuda_args))
    assert_matches(out, lse, args, clean, allowed)


@pytest.mark.gpu
@needs_cuda
def test_registered_ops_run_the_triton_kernels_under_the_bound_on_gpu():
    """The ops the passes insert, compiled by Inductor on CUDA, take the bound to the
    Triton kernels (no reference fallback) and agree with float64."""
    from torch._inductor.utils import run_and_get_code

    args, clean, allowed = PREFIX_CASES["chunk"]
    w_args, w_clean, w_allowed = WINDOW_CASES["chunk"]

    def step(q, k, v, kv_len, kv_start, wq, wk, wv, positions, lower):
        prefix = torch.ops.dcp.prefix_attention(q, k, v, kv_len, SCALE, kv_start)
        window = torch.ops.dcp.window_attention(wq, wk, wv, positions, SCALE, lower)
        return prefix, window

    inputs = [args[n] for n in ("q", "k_cache", "v_cache", "kv_len", "kv_start")]
    inputs += [w_args[n] for n in ("q", "k_new", "v_new", "positions", "lower")]
    (prefix, window), code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True),
                                              *(x.cuda() for x in inputs))
    code = "\n".join(code)
    assert "_flash_fwd_kernel" in code and "dcp.prefix_attention" not in code and "dcp.window_attention" not in code
    assert_matches(*(x.cpu() for x in prefix), args, clean, allowed)
    assert_matches(*(x.cpu() for x in window), w_args, w_clean, w_allowed)


def _trace_with_bound(op: str, device: str, t: int):
    """The graph AOTAutograd hands its backend for one call of ``op`` with its bound."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        q = torch.empty(2, 8, t, 64, device=device, dtype=torch.bfloat16)
        kv = torch.empty(2, 2, t if op == "window" else 300, 64, device=device, dtype=torch.bfloat16)
        meta = torch.empty((2, t) if op == "window" else (2,), device=device, dtype=torch.int64)
        bound = torch.empty(2, device=device, dtype=torch.int64)

    def f(q, k, v, meta, bound):
        return getattr(torch.ops.dcp, f"{op}_attention")(q, k, v, meta, SCALE, bound)

    props = mock.Mock(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, kv, kv, meta, bound)


@pytest.mark.parametrize("op,t,kernels", [
    ("window", 1, ["_flash_fwd_kernel"]),
    ("window", 100, ["_flash_fwd_kernel"]),
    ("prefix", 16, ["_prefix_split_kernel", "_merge_splits_kernel"]),
    ("prefix", 17, ["_prefix_split_kernel", "_merge_splits_kernel"]),  # 4 flash tiles: the split-KV kernel
    ("prefix", 2048, ["_flash_fwd_kernel"]),  # a prefill chunk: 256 flash tiles
])
def test_cuda_graphs_take_the_bound_to_the_triton_kernels(op, t, kernels):
    """Compiled for CUDA, a bounded op is its Triton kernels (no reference fallback), and
    the bound is one of the launch's tensors."""
    from tests.ops.test_triton_flash import _calls

    gm = _trace_with_bound(op, "cuda", t)
    calls = _calls(gm)
    assert f"dcp.{op}_attention.default" not in calls
    assert [c for c in calls if c.startswith("_")] == kernels
    bound = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    launch = next(n for n in gm.graph.nodes if "kernel_idx" in n.kwargs)
    assert bound in launch.kwargs["tensors"].values() if "tensors" in launch.kwargs else bound in launch.all_input_nodes
