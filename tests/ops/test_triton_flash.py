"""The Triton flash-attention kernels (prefix and window forms) against float64.

On CPU the kernels run under Triton's interpreter: all cases in one spawned process
(the same ``patch_interpreter`` as ``triton_interpret.py``), then each test checks its
own case.  Prefix inputs hold NaN in every slot at or past ``kv_len`` while the
reference reads clean copies, and one case also runs on clean slots, whose results
must be bitwise the same.  Most cases use 16 x 16 tiles so that a few dozen tokens
already cross several query tiles and key blocks; ``default-blocks`` cases run the
tiles the GPU gets.  The same cases, every dtype and head dim, and the Inductor
lowering run on a GPU with ``pytest -m gpu``.
"""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.ops.triton_flash import prefix_flash_triton, window_flash_triton
from dcp_compile.ops.triton_prefix import SPLIT_KV_MAX_TOKENS
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
SCALE = 0.2
FP32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# lse comes from exact products of the (rounded) inputs accumulated in fp32 whatever
# the dtype, so it stays at fp32 accuracy; out's bound for 16-bit inputs is measured
# per case against an independent reference computed in that dtype (reference_16bit).
LSE_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
SMALL = dict(block_m=16, block_n=16)


def _randn(gen, *shape, dtype, strided=False):
    """``shape`` [B, H, N, D]; ``strided`` gives a D-major window of a larger buffer."""
    if not strided:
        return torch.randn(*shape, generator=gen).to(dtype)
    b, h, n, d = shape
    return torch.randn(b, h, d, n + 9, generator=gen).to(dtype).transpose(2, 3)[:, :, 4 : 4 + n]


def prefix_case(seed, *, t=37, hq=4, hkv=2, d=16, s=70, kv_len=(0, 70, 33), dtype=torch.float32, poison=True,
                strided=False, blocks=SMALL, dv=None):
    """Op arguments (NaN in the unused slots unless ``poison=False``) and the allowed mask.
    ``dv``: values of another width than the keys, through ``prefix_attention_any_width``."""
    gen = torch.Generator().manual_seed(seed)
    b = len(kv_len)
    q = _randn(gen, b, t, hq, d, dtype=dtype).transpose(1, 2) if strided else _randn(gen, b, hq, t, d, dtype=dtype)
    k = _randn(gen, b, hkv, s, d, dtype=dtype, strided=strided)
    v = _randn(gen, b, hkv, s, dv or d, dtype=dtype, strided=strided)
    lengths = torch.tensor(kv_len)
    unused = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, :, None]
    if poison:
        k, v = k.masked_fill(unused, float("nan")), v.masked_fill(unused, float("nan"))
    allowed = (torch.arange(s)[None, :] < lengths[:, None])[:, None, :].expand(-1, t, -1)
    if dv is not None:
        return "prefix_attention_any_width", dict(q=q, k_cache=k, v_cache=v, kv_len=lengths, scale=SCALE), allowed
    return "prefix_flash_triton", dict(q=q, k_cache=k, v_cache=v, kv_len=lengths, scale=SCALE, **blocks), allowed


def window_case(seed, positions, *, hq=4, hkv=2, d=16, dtype=torch.float32, strided=False, blocks=SMALL, dv=None):
    """``dv``: values of another width than the keys."""
    gen = torch.Generator().manual_seed(seed)
    b, t = positions.shape
    q = _randn(gen, b, t, hq, d, dtype=dtype).transpose(1, 2) if strided else _randn(gen, b, hq, t, d, dtype=dtype)
    k = _randn(gen, b, hkv, t, d, dtype=dtype, strided=strided)
    v = _randn(gen, b, hkv, t, dv or d, dtype=dtype, strided=strided)
    allowed = positions[:, None, :] <= positions[:, :, None]
    return "window_flash_triton", dict(q=q, k_new=k, v_new=v, positions=positions, scale=SCALE, **blocks), allowed


def ascending(t, starts=(0, 7, 100)):
    return torch.tensor(starts)[:, None] + torch.arange(t)


def build_cases():
    gen = torch.Generator().manual_seed(123)
    t = 37  # neither a multiple of the 16-row tiles nor of the 16-key blocks
    cases = {
        # Prefix: kv_len 0, S and mid-block in every case.
        "prefix-g2-fp32": prefix_case(1),
        "prefix-g2-fp32-clean": prefix_case(1, poison=False),
        "prefix-g1-fp32": prefix_case(2, hq=2, hkv=2),
        "prefix-g3-fp32": prefix_case(3, hq=6, hkv=2),  # 16-row tiles split a token's 3 heads
        "prefix-one-token": prefix_case(4, t=1, kv_len=(0, 70, 1)),
        "prefix-bf16": prefix_case(5, dtype=torch.bfloat16),
        "prefix-fp16": prefix_case(6, t=20, dtype=torch.float16),
        "prefix-d64": prefix_case(7, t=20, d=64, kv_len=(17, 0, 70)),
        "prefix-strided": prefix_case(8, t=20, kv_len=(70, 33, 0), strided=True),
        "prefix-default-blocks": prefix_case(9, t=20, s=150, kv_len=(150, 0, 77), blocks={}),
        # Window: the usual ascending positions from per-sequence starts, and arbitrary ones.
        "window-g2-fp32": window_case(11, ascending(t)),
        "window-g1-fp32": window_case(12, ascending(t), hq=2, hkv=2),
        "window-g3-fp32": window_case(13, ascending(t), hq=6, hkv=2),
        "window-one-token": window_case(14, ascending(1)),
        "window-shuffled": window_case(15, torch.stack([torch.randperm(t, generator=gen) * 3 for _ in range(3)])),
        "window-duplicates": window_case(16, torch.randint(0, 6, (3, t), generator=gen)),
        "window-descending": window_case(17, ascending(t).flip(-1)),  # the last key is seen by every query
        "window-int32-bf16": window_case(18, ascending(t).to(torch.int32), dtype=torch.bfloat16),
        "window-fp16": window_case(19, ascending(20), dtype=torch.float16),
        "window-d64": window_case(20, ascending(20), d=64),
        "window-strided": window_case(21, ascending(20), strided=True),
        "window-default-blocks": window_case(22, torch.cat([ascending(70)[:2], torch.randperm(70)[None]]), blocks={}),
        # Keys and values of other widths, zero-padded to a kernel width (transformers'
        # expanded MLA: keys nope + rope wide, values narrower; Phi-3's 96).
        "any-width-prefix-decode": prefix_case(31, t=1, d=24, dv=16),  # the split-KV kernel
        "any-width-prefix-verify-bf16": prefix_case(32, t=4, d=24, dv=16, dtype=torch.bfloat16),
        "any-width-prefix-chunk": prefix_case(33, t=37, d=24, dv=16),  # the flash kernel
        "any-width-prefix-96": prefix_case(34, t=5, d=96, dv=96, kv_len=(70, 1, 0)),
        "any-width-prefix-192-128": prefix_case(35, t=2, hq=2, hkv=2, d=192, dv=128, s=40, kv_len=(40, 0, 17)),
        "any-width-window": window_case(36, ascending(t), d=24, dv=16),
        "any-width-window-bf16": window_case(37, ascending(20), d=24, dv=16, dtype=torch.bfloat16),
        # the flash kernel's masks on the head axis: a prefill chunk at transformers' MLA widths, values
        # wider than keys, and a window over D-major keys and values of widths under the tile's
        "any-width-chunk-192-128-bf16": prefix_case(38, t=20, hq=2, hkv=1, d=192, dv=128, s=50, kv_len=(50, 3, 0),
                                                    dtype=torch.bfloat16),
        "any-width-chunk-wider-values": prefix_case(39, t=25, d=16, dv=40),
        "any-width-window-strided": window_case(40, ascending(19), d=96, dv=72, strided=True),
    }
    return cases


CASES = build_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("triton_flash")
    torch.save({name: (op, args) for name, (op, args, _) in CASES.items()}, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder / "cases.pt"), str(folder / "results.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


def _kv(args):
    return (args["k_cache"], args["v_cache"]) if "k_cache" in args else (args["k_new"], args["v_new"])


def reference_16bit(q, k, v, allowed, scale):
    """Independent attention in the inputs' 16-bit dtype, every product's result rounded
    to it (as eager bf16 math is): how far such a result honestly is from float64 bounds
    the kernel's error."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num().to(q.dtype)
    return probs @ v


def check_against_reference(out, lse, args, allowed):
    """A kernel result for ``args`` against float64: rows with no key exactly 0 / -inf, no NaN."""
    q = args["q"]
    k, v = (x.nan_to_num(0.0) for x in _kv(args))  # poisoned slots are outside ``allowed``
    ref_out, ref_lse = attention_float64(q, k, v, allowed, SCALE)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = ~allowed.any(-1)[:, None, :].expand_as(lse)  # [B, Hq, T]
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    seen = ~empty
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], **LSE_TOLERANCE)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double()[seen], ref_out[seen], **FP32_TOLERANCE)
    else:
        low = reference_16bit(q, k, v, allowed, SCALE).double()
        budget = (low - ref_out)[seen].abs().max().item()
        error = (out.double() - ref_out)[seen].abs().max().item()
        # budget 0 only where each row sees one key (a tree's lone nodes): out is then that value, exactly
        assert budget < 0.1 and (budget > 0 or error == 0), f"the {q.dtype} reference is off by {budget}: the case is broken"
        assert error <= budget, f"kernel off float64 by {error:.2e}, a {q.dtype} reference by {budget:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference(interpreted, name):
    check_against_reference(*interpreted[name], *CASES[name][1:])


def test_nan_in_unused_slots_changes_no_bit(interpreted):
    poisoned, clean = interpreted["prefix-g2-fp32"], interpreted["prefix-g2-fp32-clean"]
    assert CASES["prefix-g2-fp32"][1]["k_cache"].isnan().any()
    assert not CASES["prefix-g2-fp32-clean"][1]["k_cache"].isnan().any()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1]["q"].dtype == torch.float32])
def test_kernel_agrees_with_the_cpu_op(interpreted, name):
    """The torch op's CPU kernel (the spec the passes call) and the flash kernel, on the same inputs."""
    op, args, _ = CASES[name]
    extra = args["kv_len"] if op.startswith("prefix") else args["positions"]
    cpu_op = torch.ops.dcp.prefix_attention if op.startswith("prefix") else torch.ops.dcp.window_attention
    ref_out, ref_lse = cpu_op(args["q"], *_kv(args), extra, SCALE)
    out, lse = interpreted[name]
    torch.testing.assert_close(out, ref_out, **FP32_TOLERANCE)
    torch.testing.assert_close(lse, ref_lse, **FP32_TOLERANCE)


def _window_args(**change):
    _, args, _ = window_case(0, ascending(5, starts=(0, 3)))
    return {**args, **change}


def _prefix_args(**change):
    _, args, _ = prefix_case(0, t=5, kv_len=(3, 70))
    return {**args, **change}


@pytest.mark.parametrize("d,dv", [(512, 512), (192, 320)])
@pytest.mark.parametrize("form", ["prefix", "window"])
def test_keys_or_values_past_256_are_refused_with_the_fix(d, dv, form):
    if form == "prefix":
        _, args, _ = prefix_case(0, t=5, d=d, dv=dv, kv_len=(3, 70))
        call = prefix_flash_triton
    else:
        _, args, _ = window_case(0, ascending(5, starts=(0, 3)), d=d, dv=dv)
        call = window_flash_triton
    with pytest.raises(ValueError, match=rf"at most 256 wide, got {d} and {dv}: run the reference"):
        call(**args)


@pytest.mark.parametrize("call,args,error,match", [
    (prefix_flash_triton, lambda: _prefix_args(kv_len=torch.tensor([3.0, 5.0])), ValueError,
     r"kv_len must be an integer tensor \[2\]"),
    (prefix_flash_triton, lambda: _prefix_args(kv_len=torch.tensor([3, 5, 7])), ValueError, "kv_len"),
    (prefix_flash_triton, lambda: _prefix_args(q=torch.randn(2, 3, 5, 16)), ValueError, "Hq a multiple of Hkv"),
    (prefix_flash_triton, lambda: _prefix_args(q=torch.randn(2, 4, 5, 16, dtype=torch.float64)), TypeError,
     "one dtype among"),
    (prefix_flash_triton, lambda: _prefix_args(v_cache=torch.randn(2, 2, 71, 16)), ValueError,
     r"v_cache \[B,Hkv,S,Dv\]"),
    (prefix_flash_triton, lambda: _prefix_args(kv_len=torch.tensor([3, 5], device="meta")), ValueError,
     "on one device"),
    (prefix_flash_triton, lambda: _prefix_args(block_m=8), ValueError, "block_m must be one of"),
    (window_flash_triton, lambda: _window_args(positions=torch.arange(5)), ValueError,
     r"positions must be an integer tensor \[2, 5\]"),
    (window_flash_triton, lambda: _window_args(positions=torch.ones(2, 5, dtype=torch.bool)), ValueError,
     "positions must be an integer"),
    (window_flash_triton, lambda: _window_args(k_new=torch.randn(2, 2, 6, 16), v_new=torch.randn(2, 2, 6, 16)),
     ValueError, "same T"),
    (window_flash_triton, lambda: _window_args(k_new=torch.randn(2, 2, 5, 16).half()), TypeError, "one dtype"),
    (window_flash_triton, lambda: _window_args(block_n=256), ValueError, "block_n must be one of"),
], ids=["kv_len-float", "kv_len-shape", "heads", "float64", "kv-shapes", "device", "block_m",
        "positions-shape", "positions-bool", "window-T", "window-dtype", "block_n"])
def test_bad_inputs_are_refused_with_what_was_expected(call, args, error, match):
    with pytest.raises(error, match=match):
        call(**args())


def _trace(op, device, t, batch=2):
    """The graph AOTAutograd hands its backend for one call of ``op`` with ``t`` new tokens."""
    with FakeTensorMode():
        q = torch.empty(batch, 8, t, 64, device=device, dtype=torch.bfloat16)
        kv = torch.empty(batch, 2, t if op == "window" else 300, 64, device=device, dtype=torch.bfloat16)
        meta = torch.empty((batch, t) if op == "window" else (batch,), device=device, dtype=torch.int64)

    def f(q, k, v, meta):
        return getattr(torch.ops.dcp, f"{op}_attention")(q, k, v, meta, SCALE)

    props = mock.Mock(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, kv, kv, meta)


def _calls(graph):
    """Targets of the graph's calls, a Triton launch named by its kernel."""
    names = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if "kernel_idx" in node.kwargs:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            names.append(getattr(kernel, "fn", kernel).__name__)
        else:
            names.append(str(node.target))
    return names


SPLIT = ["_prefix_split_kernel", "_merge_splits_kernel"]


@pytest.mark.parametrize("op,batch,t,kernels", [
    ("window", 2, 1, ["_flash_fwd_kernel"]),
    ("window", 2, 100, ["_flash_fwd_kernel"]),
    ("prefix", 2, SPLIT_KV_MAX_TOKENS, SPLIT),  # decode, chain and tree verifies: always split-KV
    ("prefix", 64, SPLIT_KV_MAX_TOKENS, ["_prefix_split_kernel"]),  # 512 programs: no slices to merge
    ("prefix", 2, 64, SPLIT),  # a wide verify whose flash tiles (4) would leave the GPU idle
    ("prefix", 64, SPLIT_KV_MAX_TOKENS + 1, ["_flash_fwd_kernel"]),  # 320 flash tiles fill it
    ("prefix", 2, 2048, ["_flash_fwd_kernel"]),  # a prefill chunk: 128 tiles
])
def test_compiled_cuda_graph_holds_the_right_triton_kernel(op, batch, t, kernels):
    calls = _calls(_trace(op, "cuda", t, batch))
    assert f"dcp.{op}_attention.default" not in calls
    assert [c for c in calls if c.startswith("_")] == kernels


@pytest.mark.parametrize("op", ["prefix", "window"])
def test_compiled_cpu_graph_keeps_the_reference_op(op):
    calls = _calls(_trace(op, "cpu", 32))
    assert calls.count(f"dcp.{op}_attention.default") == 1
    assert not any(c.startswith("_") for c in calls)


def test_eager_cuda_calls_have_a_kernel_of_their_own():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dcp::window_attention", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dcp::prefix_attention", "CUDA")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(args):
    return {key: a.cuda() if isinstance(a, torch.Tensor) else a for key, a in args.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference_on_gpu(name):
    op, args, allowed = CASES[name]
    if op.endswith("any_width"):  # what the registered op's CUDA kernel runs for these widths
        call = torch.ops.dcp.prefix_attention if op.startswith("prefix") else torch.ops.dcp.window_attention
    else:
        call = getattr(torch.ops.dcp, op)
    out, lse = (x.cpu() for x in call(**_cuda(args)))
    check_against_reference(out, lse, args, allowed)


@pytest.mark.gpu
@needs_cuda
def test_inductor_runs_keys_and_values_of_other_widths_on_the_kernels():
    """transformers' expanded MLA widths (keys 192, values 128) at a verify step: the
    split-KV kernel reads them unpadded (no zero-padded copy of the cache in the compiled
    graph) and no opaque call of the reference (which reads kv_len on the host)."""
    from torch._inductor.utils import run_and_get_code

    _, prefix, allowed = prefix_case(52, t=4, hq=8, d=192, dv=128, s=300, kv_len=(0, 300, 117), dtype=torch.bfloat16)

    def step(q, k, v, kv_len):
        out, lse = torch.ops.dcp.prefix_attention(q, k, v, kv_len, SCALE)
        return out * 2, lse

    (out, lse), code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True),
                                        *(prefix[n].cuda() for n in ("q", "k_cache", "v_cache", "kv_len")))
    code = "\n".join(code)
    assert "_prefix_split_kernel" in code and "dcp.prefix_attention" not in code
    assert "constant_pad_nd" not in code
    check_against_reference((out / 2).cpu(), lse.cpu(), prefix, allowed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("form", ["prefix", "window"])
def test_every_dtype_and_head_dim_fits_the_gpu(form, dtype, d):
    """The default tiles stay within shared memory and registers for every D and dtype,
    through the registered op (T past SPLIT_KV_MAX_TOKENS reaches the flash kernel)."""
    if form == "prefix":
        _, args, allowed = prefix_case(30 + d, t=300, hq=8, d=d, s=700, kv_len=(700, 0, 333), dtype=dtype, blocks={})
    else:
        shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(d))
        positions = torch.cat([ascending(300)[:2], shuffled[None]])
        _, args, allowed = window_case(40 + d, positions, hq=8, d=d, dtype=dtype, blocks={})
    out, lse = getattr(torch.ops.dcp, f"{form}_attention")(**_cuda(args))
    check_against_reference(out.cpu(), lse.cpu(), args, allowed)


@pytest.mark.gpu
@needs_cuda
def test_inductor_emits_the_flash_kernels_on_gpu():
    from torch._inductor.utils import run_and_get_code

    _, prefix, prefix_allowed = prefix_case(50, t=64, s=1000, kv_len=(0, 1000, 617), dtype=torch.bfloat16, blocks={})
    _, window, window_allowed = window_case(51, ascending(64), dtype=torch.bfloat16, blocks={})
    window["q"] = prefix["q"]  # one query tensor, as at an attention site
    q, k, v, kv_len = (prefix[n].cuda() for n in ("q", "k_cache", "v_cache", "kv_len"))
    k_new, v_new, positions = (window[n].cuda() for n in ("k_new", "v_new", "positions"))

    def step(q, k, v, kv_len, k_new, v_new, positions):
        p_out, p_lse = torch.ops.dcp.prefix_attention(q, k, v, kv_len, SCALE)
        w_out, w_lse = torch.ops.dcp.window_attention(q, k_new, v_new, positions, SCALE)
        return p_out * 2, p_lse, w_out * 2, w_lse

    results, code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True),
                                     q, k, v, kv_len, k_new, v_new, positions)
    code = "\n".join(code)
    assert "_flash_fwd_kernel" in code
    assert "dcp.prefix_attention" not in code and "dcp.window_attention" not in code  # no opaque fallback
    p_out, p_lse, w_out, w_lse = (r.cpu() for r in results)
    check_against_reference(p_out / 2, p_lse, prefix, prefix_allowed)
    check_against_reference(w_out / 2, w_lse, window, window_allowed)
