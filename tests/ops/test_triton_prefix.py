"""The Triton prefix kernel against the float64 reference.

On CPU the kernel runs under Triton's interpreter: all cases in one spawned process
(``triton_interpret.py``), then each test checks its own case.  The inputs hold NaN in
every slot at or past ``kv_len`` while the reference reads clean copies, so a leak
shows up as NaN or as a mismatch.  The same cases, every dtype and head dim, and the
Inductor lowering run compiled on a GPU with ``pytest -m gpu``.
"""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from dcp_compile.ops.triton_prefix import (
    MAX_SPLITS, SPLIT_KV_MAX_TOKENS, prefix_attention_triton, prefix_kernel, split_plan,
)
from tests.ops.test_attention import attention_float64

WORKER = Path(__file__).with_name("triton_interpret.py")
SCALE = 0.125
# fp32: the kernel's math is fp32 throughout (ieee dots).  bf16/fp16: the probabilities
# are rounded to the input dtype before the PV product (8 or 11 bits), so out is off by
# up to a few units of that rounding times |v| (~1..4 here); lse comes from exact
# products of the rounded inputs accumulated in fp32, so it stays at fp32 accuracy.
TOLERANCE = {
    torch.float32: dict(out=dict(atol=1e-5, rtol=1e-5), lse=dict(atol=1e-5, rtol=1e-5)),
    torch.float16: dict(out=dict(atol=4e-3, rtol=4e-3), lse=dict(atol=1e-5, rtol=1e-5)),
    torch.bfloat16: dict(out=dict(atol=3e-2, rtol=3e-2), lse=dict(atol=1e-5, rtol=1e-5)),
}


def make_case(seed, *, t=1, g=4, hkv=2, d=64, dv=None, s=150, kv_len=(0, 150, 77), dtype=torch.float32,
              num_splits=None, block_s=None, strided=False):
    """Op arguments with NaN in the unused slots, and clean K/V for the reference; values
    ``dv`` wide (``d`` unless given)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(kv_len)
    dv = d if dv is None else dv
    q = torch.randn(b, hkv * g, t, d, generator=gen).to(dtype)
    if strided:  # a window of a larger, D-major cache: no unit stride along D
        k = torch.randn(b, hkv, d, s + 20, generator=gen).to(dtype).transpose(2, 3)[:, :, 10 : 10 + s]
        v = torch.randn(b, hkv, dv, s + 20, generator=gen).to(dtype).transpose(2, 3)[:, :, 10 : 10 + s]
    else:
        k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
        v = torch.randn(b, hkv, s, dv, generator=gen).to(dtype)
    lengths = torch.tensor(kv_len)
    unused = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, :, None]
    args = dict(q=q, k_cache=k.masked_fill(unused, float("nan")), v_cache=v.masked_fill(unused, float("nan")),
                kv_len=lengths, scale=SCALE, num_splits=num_splits, block_s=block_s)
    return args, (k, v)


def build_cases():
    cases = {}
    for t in (1, 5, 16):
        for g in (1, 4):
            for dtype in (torch.float32, torch.bfloat16):
                cases[f"t{t}-g{g}-{str(dtype)[6:]}"] = make_case(t * 10 + g, t=t, g=g, dtype=dtype)
    # kv_len 0, S, and lengths that end mid-block, with every split layout.
    # Tree verifies wider than one program's rows: 4 x 40 rows over two 128-row blocks (the
    # default past 64 rows), and 4 x 24 over two 64-row blocks (the override).
    cases["wide-verify-row-blocks"] = make_case(7, t=40, g=4, num_splits=2)
    args, clean = make_case(8, t=24, g=4, num_splits=2)
    cases["wide-verify-64-rows"] = ({**args, "rows": 64}, clean)
    cases["one-split"] = make_case(1, t=5, num_splits=1)
    cases["splits-past-length"] = make_case(2, t=5, s=256, kv_len=(0, 256, 77), num_splits=8, block_s=32)
    cases["uneven-splits"] = make_case(3, t=1, s=200, kv_len=(199, 0, 33), num_splits=3, block_s=16)
    # Sequences far shorter than the cache: each is cut into the slices by its own length.
    cases["short-in-long-cache"] = make_case(8, t=2, s=1024, kv_len=(40, 300, 17), num_splits=8, block_s=16)
    # The most slices the merge takes (its 8-warp launch), one 16-slot block each.
    cases["most-splits"] = make_case(14, t=1, g=2, hkv=1, s=2048, kv_len=(2048, 1000, 0), num_splits=128, block_s=16)
    cases["row-blocks"] = make_case(4, t=16, g=8, hkv=1, kv_len=(150, 50))  # 128 rows: two row blocks
    cases["fp16"] = make_case(5, t=5, dtype=torch.float16)
    cases["strided-cache"] = make_case(6, t=5, kv_len=(150, 3, 64), strided=True)
    cases["head-dim-16"] = make_case(7, t=1, d=16, kv_len=(150, 1, 64))
    # Keys and values read unpadded under a mask on the head axis: transformers' expanded
    # MLA (192 and 128), Phi-3's 96, values wider than keys, a width under the tile's 16,
    # and a D-major cache whose rows the mask must not run past.
    cases["unpadded-192-128-bf16"] = make_case(9, t=1, g=1, d=192, dv=128, s=40, kv_len=(40, 0, 17),
                                               dtype=torch.bfloat16)
    cases["unpadded-96-verify"] = make_case(10, t=4, d=96, kv_len=(150, 1, 0), num_splits=3, block_s=32)
    cases["unpadded-24-48"] = make_case(11, t=2, d=24, dv=48, s=70, kv_len=(70, 33, 5))
    cases["unpadded-8"] = make_case(12, t=1, d=8, s=64, kv_len=(64, 9, 0))
    cases["unpadded-strided"] = make_case(13, t=3, d=40, dv=24, kv_len=(150, 77, 2), strided=True)
    return cases


CASES = build_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("triton_interpret")
    torch.save({name: args for name, (args, _) in CASES.items()}, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "results.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


def assert_matches_reference(out, lse, name):
    """Kernel output of case ``name`` against float64: empty rows exactly 0 / -inf, no NaN."""
    args, (k, v) = CASES[name]
    assert_matches_float64(out, lse, args["q"], k, v, args["kv_len"], SCALE)


def assert_matches_float64(out, lse, q, k, v, kv_len, scale):
    """A prefix kernel's ``(out, lse)`` against float64 attention over slots ``[0, kv_len)``."""
    allowed = (torch.arange(k.shape[2])[None, :] < kv_len[:, None])[:, None, :].expand(-1, q.shape[2], -1)
    ref_out, ref_lse = attention_float64(q, k, v, allowed, scale)
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = kv_len == 0
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double()[~empty], ref_out[~empty], **tol["out"])
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], **tol["lse"])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference(interpreted, name):
    q = CASES[name][0]["q"]
    out, lse = interpreted[name]
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], CASES[name][0]["v_cache"].shape[-1]) and lse.shape == q.shape[:3]
    assert_matches_reference(out, lse, name)


@pytest.mark.parametrize("d,dv", [(512, 512), (192, 320)])
def test_keys_or_values_past_256_are_refused_with_the_fix(d, dv):
    args, _ = make_case(0, d=d, dv=dv)
    with pytest.raises(ValueError, match=rf"at most 256 wide, got {d} and {dv}: run the reference"):
        prefix_attention_triton(**args)


def test_num_splits_out_of_range_is_refused():
    args, _ = make_case(0)
    with pytest.raises(ValueError, match="num_splits"):
        prefix_attention_triton(**{**args, "num_splits": MAX_SPLITS + 1})


@pytest.mark.parametrize("batch,capacity", [(1, 4096), (8, 8192), (8, 65536), (64, 131072), (3, 150), (2, 1)])
def test_split_plan_covers_the_cache_in_one_wave(batch, capacity):
    block, kv_heads, sms = 128, 8, 132
    num_splits, split_len = split_plan(batch, kv_heads, 1, capacity, block, sm_count=sms)
    assert split_len % block == 0 and 1 <= num_splits <= MAX_SPLITS
    assert (num_splits - 1) * split_len < capacity <= num_splits * split_len  # no empty slice at the end
    programs = batch * kv_heads * num_splits
    assert programs <= sms or num_splits == 1
    if -(-capacity // block) >= sms:  # long enough to split: more than half the SMs busy
        assert programs > sms // 2


@pytest.mark.parametrize("batch,tokens,expected", [
    (1, 4, "split"), (64, 16, "split"), (8, 64, "split"),  # decode, chain and tree verifies, any batch
    (4, SPLIT_KV_MAX_TOKENS, "split"),  # 128 flash tiles, but no wider than a verify step
    (1, 256, "split"),  # 64 flash tiles of 132 SMs
    (8, 256, "flash"), (1, 512, "flash"),  # 512 and 128 tiles: full waves
])
def test_prefix_kernel_is_chosen_by_its_tiles_against_the_sms(batch, tokens, expected):
    """Llama-3-8B heads (32 / 8, bf16 D=128) on 132 SMs: the flash kernel only past
    ``SPLIT_KV_MAX_TOKENS`` and once its ``B * Hkv * ceil(G * T / 128)`` tiles reach half the SMs."""
    assert prefix_kernel(batch, 32, 8, tokens, 128, 2, sm_count=132) == expected
    if expected == "flash":  # the same tiles on a GPU of more than twice their SMs: split again
        tiles = batch * 8 * -(-4 * tokens // 128)
        assert prefix_kernel(batch, 32, 8, tokens, 128, 2, sm_count=2 * tiles + 1) == "split"


def _trace(device, cuda_sm_count=132):
    """The graph AOTAutograd hands its backend for one prefix_attention call on ``device``."""
    with FakeTensorMode():
        q = torch.empty(2, 8, 1, 64, device=device, dtype=torch.bfloat16)
        cache = torch.empty(2, 2, 300, 64, device=device, dtype=torch.bfloat16)
        kv_len = torch.empty(2, device=device, dtype=torch.int64)

    def f(q, k, v, kv_len):
        return torch.ops.dcp.prefix_attention(q, k, v, kv_len, SCALE)

    props = mock.Mock(multi_processor_count=cuda_sm_count)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, cache, cache, kv_len)


def test_compiled_cuda_graph_holds_the_triton_kernels_not_the_opaque_op():
    targets = [str(n.target) for n in _trace("cuda").graph.nodes if n.op == "call_function"]
    assert "dcp.prefix_attention.default" not in targets
    assert targets.count("triton_kernel_wrapper_functional") == 2  # split kernel, then the merge of its splits


def test_compiled_cpu_graph_keeps_the_reference_op():
    targets = [str(n.target) for n in _trace("cpu").graph.nodes if n.op == "call_function"]
    assert targets.count("dcp.prefix_attention.default") == 1
    assert not any("triton" in t for t in targets)


def test_eager_cuda_calls_have_a_kernel_of_their_own():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dcp::prefix_attention", "CUDA")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference_on_gpu(name):
    args = CASES[name][0]
    cuda_args = {key: a.cuda() if isinstance(a, torch.Tensor) else a for key, a in args.items()}
    out, lse = (x.cpu() for x in prefix_attention_triton(**cuda_args))
    assert_matches_reference(out, lse, name)


@pytest.mark.gpu
@needs_cuda
def test_inductor_emits_the_triton_kernels_on_gpu():
    from torch._inductor.utils import run_and_get_code

    args, (k_clean, v_clean) = make_case(8, t=4, s=1000, kv_len=(0, 1000, 617), dtype=torch.bfloat16)
    q, k, v, kv_len = (args[n].cuda() for n in ("q", "k_cache", "v_cache", "kv_len"))

    def step(q, k, v, kv_len):
        out, lse = torch.ops.dcp.prefix_attention(q, k, v, kv_len, SCALE)
        return out * 2, lse

    (out, lse), code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), q, k, v, kv_len)
    code = "\n".join(code)
    assert "_prefix_split_kernel" in code and "_merge_splits_kernel" in code
    assert "dcp.prefix_attention" not in code  # no opaque fallback call
    allowed = (torch.arange(1000)[None, :] < args["kv_len"][:, None])[:, None, :].expand(-1, 4, -1)
    ref_out, ref_lse = attention_float64(args["q"], k_clean, v_clean, allowed, SCALE)
    seen = args["kv_len"] > 0
    torch.testing.assert_close((out / 2).cpu().double()[seen], ref_out[seen], **TOLERANCE[torch.bfloat16]["out"])
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen], **TOLERANCE[torch.bfloat16]["lse"])
    assert (lse[~seen.cuda()] == float("-inf")).all() and (out[~seen.cuda()] == 0).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_every_dtype_and_head_dim_fits_the_gpu(dtype, d):
    """The default block and stage count stay within shared memory for every D and dtype."""
    args, (k, v) = make_case(9, t=16, g=4, d=d, s=700, kv_len=(700, 0, 333), dtype=dtype)
    out, lse = (x.cpu() for x in prefix_attention_triton(
        **{key: a.cuda() if isinstance(a, torch.Tensor) else a for key, a in args.items()}))
    allowed = (torch.arange(700)[None, :] < args["kv_len"][:, None])[:, None, :].expand(-1, 16, -1)
    ref_out, ref_lse = attention_float64(args["q"], k, v, allowed, SCALE)
    seen = args["kv_len"] > 0
    torch.testing.assert_close(out.double()[seen], ref_out[seen], **TOLERANCE[dtype]["out"])
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], **TOLERANCE[dtype]["lse"])
