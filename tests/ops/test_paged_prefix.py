"""Prefix attention over a paged cache (``dcp::paged_prefix_attention``).

A static cache is scattered into a pool of pages in a shuffled order, with NaN in every
page no sequence uses and in every slot past a sequence's length; the paged op must
answer exactly what the unpaged op answers over the static cache.  On CPU that is the
reference through ``gather_pages``; the split-KV kernel's paged path runs under Triton's
interpreter (one spawned process a kernel), bitwise-equal in fp32 to the unpaged kernel
over the same slots with the same slices, and close to float64 in bf16.  On a GPU
(``pytest -m gpu``) the same cases run compiled.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_compile.ops import gather_pages, paged_prefix_attention, prefix_attention
from tests.ops.test_triton_prefix import TOLERANCE, assert_matches_float64

WORKER = Path(__file__).with_name("triton_interpret.py")
SCALE = 0.125


def scatter_into_pages(caches, page, gen, spare_pages=3):
    """Static caches ``[B, H, n * page, D]`` (NaN where unused) cut into pages and scattered
    into pools with ``spare_pages`` more pages of NaN, in a shuffled order: ``(pools, table)``."""
    B, _, S, _ = caches[0].shape
    n = S // page
    pages = B * n + spare_pages
    table = torch.randperm(pages, generator=gen)[: B * n].view(B, n).to(torch.int32)
    pools = []
    for cache in caches:
        H, D = cache.shape[1], cache.shape[3]
        pool = torch.full((pages, H, page, D), float("nan"), dtype=cache.dtype)
        pool[table.reshape(-1).long()] = cache.view(B, H, n, page, D).transpose(1, 2).reshape(-1, H, page, D)
        pools.append(pool)
    return pools, table


def paged_case(seed, *, page, kv_len, capacity, t=1, g=4, hkv=2, d=64, dtype=torch.float32, spare_pages=3,
               kv_start=None, kernel=None, **tuning):
    """``(paged args, unpaged args, clean static K/V)``: the static cache ``[B, Hkv,
    capacity, D]`` cut into pages, scattered into a pool of ``spare_pages`` more pages in a
    shuffled order; unused slots and unused pages hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    B = len(kv_len)
    n = -(-capacity // page)
    k = torch.randn(B, hkv, n * page, d, generator=gen).to(dtype)
    v = torch.randn(B, hkv, n * page, d, generator=gen).to(dtype)
    lengths = torch.tensor(kv_len)
    unused = (torch.arange(n * page)[None, :] >= lengths[:, None])[:, None, :, None]
    k_nan, v_nan = k.masked_fill(unused, float("nan")), v.masked_fill(unused, float("nan"))
    (k_pool, v_pool), table = scatter_into_pages([k_nan, v_nan], page, gen, spare_pages)
    q = torch.randn(B, hkv * g, t, d, generator=gen).to(dtype)
    start = None if kv_start is None else torch.tensor(kv_start)
    paged = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_table=table, kv_len=lengths, scale=SCALE, kv_start=start,
                 kernel=kernel, **tuning)
    unpaged = dict(q=q, k_cache=k_nan, v_cache=v_nan, kv_len=lengths, scale=SCALE, kv_start=start, **tuning)
    return paged, unpaged, (k, v)


# Pages smaller than, equal to and larger than the kernel's blocks, lengths 0, mid-page,
# one page exactly and the whole table, a left-padding bound, verify widths, GQA groups.
CASES = {
    "page16-block32": paged_case(1, page=16, kv_len=(0, 150, 77), capacity=160, block_s=32, num_splits=3),
    "page64-block16": paged_case(2, page=64, kv_len=(64, 1, 200), capacity=256, t=4, block_s=16, num_splits=4),
    "page32-default": paged_case(3, page=32, kv_len=(96, 33), capacity=96, t=5, g=1),
    "page8-one-split": paged_case(4, page=8, kv_len=(40, 17, 8), capacity=48, g=8, hkv=1, num_splits=1),
    "page16-kv-start": paged_case(5, page=16, kv_len=(100, 64), capacity=112, kv_start=(20, 0), num_splits=2,
                                  block_s=16),
    "page16-bf16": paged_case(6, page=16, kv_len=(150, 3, 64), capacity=160, t=2, dtype=torch.bfloat16),
    # The flash kernel (prefill chunks): pages smaller and larger than its 64-key blocks.
    "flash-page16": paged_case(7, page=16, kv_len=(150, 0, 77), capacity=160, t=9, kernel="flash"),
    "flash-page128-kv-start": paged_case(8, page=128, kv_len=(300, 129), capacity=384, t=3, kernel="flash",
                                         kv_start=(5, 0)),
    "flash-page32-bf16": paged_case(9, page=32, kv_len=(96, 50), capacity=128, t=6, g=2, kernel="flash",
                                    dtype=torch.bfloat16),
}
FLASH = [name for name in CASES if name.startswith("flash")]


def latent_case(seed, *, page, kv_len, capacity, t=1, heads=4, c=32, r=16, dtype=torch.float32, **tuning):
    """``(paged args, unpaged args, clean latent and rope)`` for MLA's latent prefix."""
    gen = torch.Generator().manual_seed(seed)
    B, S = len(kv_len), -(-capacity // page) * page
    latent, rope = torch.randn(B, 1, S, c, generator=gen).to(dtype), torch.randn(B, 1, S, r, generator=gen).to(dtype)
    lengths = torch.tensor(kv_len)
    unused = (torch.arange(S)[None, :] >= lengths[:, None])[:, None, :, None]
    with_nan = [x.masked_fill(unused, float("nan")) for x in (latent, rope)]
    (latent_pool, rope_pool), table = scatter_into_pages(with_nan, page, gen)
    q = torch.randn(B, heads, t, c + r, generator=gen).to(dtype)
    paged = dict(q=q, latent_pool=latent_pool, rope_pool=rope_pool, block_table=table, kv_len=lengths, scale=SCALE,
                 **tuning)
    unpaged = dict(q=q, latent=with_nan[0], rope=with_nan[1], kv_len=lengths, scale=SCALE, **tuning)
    return paged, unpaged, (latent, rope)


LATENT = {
    "latent-page16": latent_case(11, page=16, kv_len=(0, 150, 77), capacity=160, num_splits=3, block_s=16),
    "latent-page64-verify": latent_case(12, page=64, kv_len=(64, 130), capacity=192, t=4, block_s=32),
    "latent-page16-bf16": latent_case(13, page=16, kv_len=(150, 5), capacity=160, t=2, dtype=torch.bfloat16),
}


def interpret(tmp_path, op, cases):
    torch.save(cases, tmp_path / f"{op}-cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / f"{op}-cases.pt"),
                           str(tmp_path / f"{op}-results.pt"), op], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(tmp_path / f"{op}-results.pt")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """Each case through the paged kernel and through the unpaged kernel, interpreted."""
    folder = tmp_path_factory.mktemp("paged_interpret")
    paged = interpret(folder, "triton_paged.paged_prefix_attention_triton",
                      {name: args for name, (args, _, _) in CASES.items()})
    unpaged = interpret(folder, "prefix_attention_triton",
                        {name: args for name, (_, args, _) in CASES.items() if name not in FLASH})
    unpaged |= interpret(folder, "triton_flash.prefix_flash_triton",
                         {name: args for name, (_, args, _) in CASES.items() if name in FLASH})
    paged |= interpret(folder, "triton_paged.paged_latent_prefix_attention_triton",
                       {name: args for name, (args, _, _) in LATENT.items()})
    unpaged |= interpret(folder, "latent_prefix_attention_triton", {name: args for name, (_, args, _) in LATENT.items()})
    return paged, unpaged


def bitwise_in_fp32(kernels, name, dtype):
    """Case ``name``'s paged ``(out, lse)``, checked equal to the unpaged kernel's in fp32: the
    same blocks, slices and order of operations, only the addresses differ."""
    (out, lse), (static_out, static_lse) = kernels[0][name], kernels[1][name]
    if dtype == torch.float32:
        assert torch.equal(out, static_out) and torch.equal(lse, static_lse)
    return out, lse


@pytest.mark.parametrize("name", list(CASES))
def test_paged_kernel_matches_the_unpaged_kernel_and_float64(kernels, name):
    paged_args, unpaged_args, (k, v) = CASES[name]
    out, lse = bitwise_in_fp32(kernels, name, paged_args["q"].dtype)
    kv_len, start = paged_args["kv_len"], paged_args["kv_start"]
    if start is None:
        assert_matches_float64(out, lse, paged_args["q"], k, v, kv_len, SCALE)
    else:  # the slots before kv_start are masked: compare with the reference op on clean K/V
        ref_out, ref_lse = prefix_attention(paged_args["q"], k, v, kv_len, SCALE, start)
        torch.testing.assert_close(out, ref_out, **TOLERANCE[paged_args["q"].dtype]["out"])
        torch.testing.assert_close(lse, ref_lse, **TOLERANCE[paged_args["q"].dtype]["lse"])


@pytest.mark.parametrize("name", list(LATENT))
def test_paged_latent_kernel_matches_the_unpaged_kernel_and_the_reference(kernels, name):
    from dcp_compile.ops import latent_prefix_attention

    paged_args, unpaged_args, (latent, rope) = LATENT[name]
    out, lse = bitwise_in_fp32(kernels, name, paged_args["q"].dtype)
    ref_out, ref_lse = latent_prefix_attention(paged_args["q"], latent, rope, paged_args["kv_len"], SCALE)
    tol = TOLERANCE[paged_args["q"].dtype]
    seen = paged_args["kv_len"] > 0
    torch.testing.assert_close(out[seen], ref_out[seen], **tol["out"])
    torch.testing.assert_close(lse[seen], ref_lse[seen], **tol["lse"])
    assert (lse[~seen] == float("-inf")).all() and (out[~seen] == 0).all()
    # On CPU the op gathers the pages and runs the reference: exactly the unpaged op's answer.
    from dcp_compile.ops import paged_latent_prefix_attention

    cpu = paged_latent_prefix_attention(*(paged_args[n] for n in ("q", "latent_pool", "rope_pool", "block_table",
                                                                  "kv_len")), SCALE)
    unpaged = latent_prefix_attention(*(unpaged_args[n] for n in ("q", "latent", "rope", "kv_len")), SCALE)
    assert all(torch.equal(a, b) for a, b in zip(cpu, unpaged))


@pytest.mark.parametrize("name", list(CASES))
def test_paged_op_on_cpu_is_the_unpaged_op_over_the_static_cache(name):
    paged_args, unpaged_args, _ = CASES[name]
    tuning = ("num_splits", "block_s", "kernel")
    out, lse = paged_prefix_attention(**{n: a for n, a in paged_args.items() if n not in tuning})
    static_out, static_lse = prefix_attention(**{n: a for n, a in unpaged_args.items() if n not in tuning})
    assert torch.equal(out, static_out) and torch.equal(lse, static_lse)


def test_gather_pages_puts_each_slot_where_the_table_says():
    pool = torch.arange(5 * 2 * 4 * 3, dtype=torch.float32).view(5, 2, 4, 3)  # 5 pages, 2 heads, 4 slots, D=3
    table = torch.tensor([[3, 0], [4, 4]])
    cache = gather_pages(pool, table)
    assert cache.shape == (2, 2, 8, 3)
    for b in range(2):
        for s in range(8):
            assert torch.equal(cache[b, :, s], pool[table[b, s // 4], :, s % 4])


@pytest.mark.parametrize("change,match", [
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), r"block_table must be an int32 or int64 tensor \[B"),
    (dict(block_table=torch.zeros(2, 2)), "int32 or int64"),
    (dict(v_pool=torch.zeros(4, 2, 8, 64)), "of the same pages, heads and page size"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), "contiguous"),
])
def test_bad_pools_and_tables_are_refused_with_what_was_expected(change, match):
    args = dict(CASES["page32-default"][0])
    with pytest.raises(ValueError, match=match):
        paged_prefix_attention(**{**{n: a for n, a in args.items() if n != "kernel"}, **change})


def _trace(device):
    """The graph AOTAutograd hands its backend for one paged call on ``device``."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        q = torch.empty(2, 8, 1, 64, device=device, dtype=torch.bfloat16)
        pool = torch.empty(20, 2, 16, 64, device=device, dtype=torch.bfloat16)
        table = torch.empty(2, 10, device=device, dtype=torch.int32)
        kv_len = torch.empty(2, device=device, dtype=torch.int64)

    def f(q, k, v, table, kv_len):
        return torch.ops.dcp.paged_prefix_attention(q, k, v, table, kv_len, SCALE)

    props = mock.Mock(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        graph = make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, pool, pool, table, kv_len)
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


def test_compiled_cuda_graph_holds_the_paged_kernels_and_cpu_keeps_the_op():
    cuda = _trace("cuda")
    assert "dcp.paged_prefix_attention.default" not in cuda
    assert cuda.count("triton_kernel_wrapper_functional") == 2  # the split kernel through the table, the merge
    assert _trace("cpu").count("dcp.paged_prefix_attention.default") == 1


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_paged_kernel_matches_the_unpaged_kernel_on_gpu(name):
    from dcp_compile.ops import paged_prefix_attention_triton, prefix_attention_triton, prefix_flash_triton

    paged_args, unpaged_args, _ = CASES[name]
    cuda = lambda args: {n: a.cuda() if isinstance(a, torch.Tensor) else a for n, a in args.items()}  # noqa: E731
    out, lse = paged_prefix_attention_triton(**cuda(paged_args))
    unpaged = prefix_flash_triton if name in FLASH else prefix_attention_triton
    static_out, static_lse = unpaged(**cuda(unpaged_args))
    assert torch.equal(out, static_out) and torch.equal(lse, static_lse)


@pytest.mark.gpu
@needs_cuda
def test_inductor_emits_the_paged_kernels_on_gpu():
    from torch._inductor.utils import run_and_get_code

    paged_args, unpaged_args, _ = paged_case(9, page=16, kv_len=(0, 1000, 617), capacity=1008, t=4,
                                             dtype=torch.bfloat16)
    names = ("q", "k_pool", "v_pool", "block_table", "kv_len")
    inputs = [paged_args[n].cuda() for n in names]

    def step(q, k, v, table, kv_len):
        out, lse = torch.ops.dcp.paged_prefix_attention(q, k, v, table, kv_len, SCALE)
        return out * 2, lse

    (out, lse), code = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), *inputs)
    code = "\n".join(code)
    assert "_prefix_split_kernel" in code and "dcp.paged_prefix_attention" not in code
    static_out, static_lse = prefix_attention(*(unpaged_args[n].cuda() for n in ("q", "k_cache", "v_cache",
                                                                                  "kv_len")), SCALE)
    assert torch.equal(out / 2, static_out) and torch.equal(lse, static_lse)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(LATENT))
def test_paged_latent_kernel_on_gpu(name):
    from dcp_compile.ops import latent_prefix_attention, latent_prefix_attention_triton
    from dcp_compile.ops import paged_latent_prefix_attention_triton

    paged_args, unpaged_args, (latent, rope) = LATENT[name]
    cuda = lambda args: {n: a.cuda() if isinstance(a, torch.Tensor) else a for n, a in args.items()}  # noqa: E731
    out, lse = (x.cpu() for x in paged_latent_prefix_attention_triton(**cuda(paged_args)))
    if "block_s" in unpaged_args and paged_args["q"].dtype == torch.float32:  # both on the split-KV kernel
        static = [x.cpu() for x in latent_prefix_attention_triton(**cuda(unpaged_args))]
        assert torch.equal(out, static[0]) and torch.equal(lse, static[1])
    ref_out, ref_lse = latent_prefix_attention(paged_args["q"], latent, rope, paged_args["kv_len"], SCALE)
    seen = paged_args["kv_len"] > 0
    torch.testing.assert_close(out[seen], ref_out[seen], **TOLERANCE[paged_args["q"].dtype]["out"])
    torch.testing.assert_close(lse[seen], ref_lse[seen], **TOLERANCE[paged_args["q"].dtype]["lse"])
