"""The Triton latent prefix kernel (MLA) against the float64 reference, under Triton's
interpreter on CPU; slots at or past each length hold NaN, so a leak shows."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dcp_compile.ops.attention import latent_prefix_attention
from dcp_compile.ops.triton_latent import latent_kernel_fits
from tests.ops.test_attention import attention_float64
from tests.ops.test_triton_prefix import WORKER, assert_matches_float64

SCALE = 0.1


def make_case(seed, *, t=1, h=4, c=32, r=16, s=150, kv_len=(0, 150, 77), dtype=torch.float32, num_splits=None,
              block_s=None, **tiles):
    gen = torch.Generator().manual_seed(seed)
    b = len(kv_len)
    q = torch.randn(b, h, t, c + r, generator=gen).to(dtype)
    latent = torch.randn(b, 1, s, c, generator=gen).to(dtype)
    rope = torch.randn(b, 1, s, r, generator=gen).to(dtype)
    lengths = torch.tensor(kv_len)
    unused = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, :, None]
    args = dict(q=q, latent=latent.masked_fill(unused, float("nan")), rope=rope.masked_fill(unused, float("nan")),
                kv_len=lengths, scale=SCALE, num_splits=num_splits, block_s=block_s, **tiles)
    return args, (latent, rope)


CASES = {
    "decode-fp32": make_case(1),
    # wide tiles: 544 x 4 bytes a slot leaves 33 slots of a stage, rounded down to 32
    "wide-fp32": make_case(7, c=512, r=32, s=70, kv_len=(70, 33)),
    "verify-fp32": make_case(2, t=4),
    "decode-bf16": make_case(3, dtype=torch.bfloat16),
    "splits": make_case(4, t=2, s=256, kv_len=(0, 256, 77), num_splits=8, block_s=16),
    "one-split": make_case(5, t=3, num_splits=1),
    "row-blocks": make_case(6, t=4, h=32, kv_len=(150, 9)),  # 128 rows: two row blocks
    # the head counts of a latent layer: 1, 16 (DeepSeek-V2-Lite) and 128 (V3); up to 16 tokens
    "h1-t16": make_case(8, t=16, h=1, s=40, kv_len=(40, 0, 17)),
    "h16-t1-bf16": make_case(9, t=1, h=16, s=40, kv_len=(40, 21), dtype=torch.bfloat16),
    "h128-t1": make_case(10, t=1, h=128, s=40, kv_len=(33, 40)),
    "h128-t4-bf16": make_case(11, t=4, h=128, s=24, kv_len=(24, 5), dtype=torch.bfloat16),
    # a prefill chunk: 40 tokens x 4 heads, blocks of 64 rows each holding one head's tokens
    "prefill-t40-bf16": make_case(14, t=40, h=4, s=200, kv_len=(200, 0, 131), dtype=torch.bfloat16),
    "prefill-t70-fp32": make_case(15, t=70, h=2, s=90, kv_len=(90, 64, 1)),
    # tiles other than the defaults: 32-row blocks over 64 query rows, a short last block of slots
    "rows32-block64": make_case(12, t=2, h=32, s=200, kv_len=(200, 130, 1), dtype=torch.bfloat16, rows=32,
                                block_s=64, num_warps=8, num_stages=2),
}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("triton_latent")
    torch.save({name: args for name, (args, _) in CASES.items()}, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "results.pt"),
                           "latent_prefix_attention_triton"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_latent_kernel_matches_float64_reference(interpreted, name):
    args, (latent, rope) = CASES[name]
    out, lse = interpreted[name]
    assert out.shape == (*args["q"].shape[:3], latent.shape[-1]) and lse.shape == args["q"].shape[:3]
    assert_matches_float64(out, lse, args["q"], torch.cat([latent, rope], dim=-1), latent, args["kv_len"], SCALE)


def test_the_op_on_cpu_is_the_reference_with_the_keys_side_by_side():
    args, (latent, rope) = CASES["verify-fp32"]
    kv_len = torch.tensor([150, 3, 77])
    out, lse = latent_prefix_attention(args["q"], latent, rope, kv_len, SCALE)
    keys = torch.cat([latent, rope], dim=-1)
    allowed = (torch.arange(150)[None, :] < kv_len[:, None])[:, None, :].expand(-1, 4, -1)
    ref_out, ref_lse = attention_float64(args["q"], keys, latent, allowed, SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("c, r, t, fits", [(512, 64, 1, True), (512, 64, 16, True), (512, 64, 4096, True),
                                           (512, 64, 262_144, False), (500, 64, 1, False), (32, 8, 1, False)])
def test_which_shapes_the_latent_kernel_takes(c, r, t, fits):
    # decode, verify and prefill chunks alike, up to the grid's 65535 blocks of 64 rows
    q = torch.empty(1, 16, t, c + r, dtype=torch.bfloat16, device="meta")
    assert latent_kernel_fits(q, torch.empty(1, 1, 8, c, dtype=torch.bfloat16), torch.empty(1, 1, 8, r)) == fits


@pytest.mark.parametrize("width, element_size", [(576, 2), (576, 4), (48, 4), (2112, 2), (80, 1)])
@pytest.mark.parametrize("rows_wanted", [1, 16, 17, 32, 64, 128, 2048])
def test_default_tiles_are_choices_the_kernel_takes_and_fit_a_stage(rows_wanted, width, element_size):
    from dcp_compile.ops.triton_latent import LATENT_STAGE_BYTES, LATENT_TILE_CHOICES, latent_tiles

    tiles = latent_tiles(rows_wanted, width, element_size)
    assert all(tiles[name] in choices for name, choices in LATENT_TILE_CHOICES.items())
    assert tiles["rows"] >= min(rows_wanted, 64), "rows past 64 take more row blocks, never fewer rows than needed"
    assert tiles["block_s"] == 16 or tiles["block_s"] * width * element_size <= LATENT_STAGE_BYTES


BAD_LATENT_INPUTS = {
    "latent of another batch": (lambda a: {**a, "latent": a["latent"][:2]}, r"must share the batch B"),
    "rope of other slots": (lambda a: {**a, "rope": a["rope"][:, :, :100]}, r"latent and rope the slots"),
    "bf16 latent, fp32 q": (lambda a: {**a, "latent": a["latent"].bfloat16()}, r"of one dtype; got torch.float32, "
                                                                               r"torch.bfloat16"),
    "float lengths": (lambda a: {**a, "kv_len": a["kv_len"].float()}, r"kv_len must be an integer tensor \[3\]"),
    "lengths of another batch": (lambda a: {**a, "kv_len": a["kv_len"][:2]}, r"kv_len must be an integer tensor"),
    "lengths on another device": (lambda a: {**a, "kv_len": a["kv_len"].to("meta")}, r"must be on one device"),
}


@pytest.mark.parametrize("name", list(BAD_LATENT_INPUTS))
def test_bad_inputs_are_refused_before_the_kernel_runs(name):
    """The kernel would read past a tensor (another batch) or fail to compile (mixed
    dtypes): each input the launch cannot run is refused with what it expected."""
    from dcp_compile.ops.triton_latent import latent_prefix_attention_triton

    change, expected = BAD_LATENT_INPUTS[name]
    args, _ = make_case(14)
    with pytest.raises((ValueError, TypeError), match=expected):
        latent_prefix_attention_triton(**change(args))


def test_a_tile_override_outside_the_choices_is_refused():
    from dcp_compile.ops.triton_latent import latent_prefix_attention_triton

    args, _ = make_case(13)
    with pytest.raises(ValueError, match=r"num_stages must be one of \(1, 2, 3, 4\), got 5"):
        latent_prefix_attention_triton(**{**args, "num_stages": 5})


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_latent_kernel_matches_float64_reference_on_gpu(name):
    from dcp_compile.ops.triton_latent import latent_prefix_attention_triton

    args, (latent, rope) = CASES[name]
    out, lse = latent_prefix_attention_triton(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert_matches_float64(out, lse, args["q"], torch.cat([latent, rope], dim=-1), latent, args["kv_len"], SCALE)


# The seesaw kernel (``gluon_latent.py``): DeepSeek's slot (512 + 64) in bf16, 64 or more
# query rows a sequence; ragged lengths with a 0, NaN in every dead slot, partial row blocks.
SEESAW_CASES = {
    "h128-t1": make_case(40, t=1, h=128, c=512, r=64, s=700, kv_len=(700, 0, 333, 64), dtype=torch.bfloat16),
    "h128-t4": make_case(41, t=4, h=128, c=512, r=64, s=200, kv_len=(200, 71), dtype=torch.bfloat16),
    "h16-t4": make_case(42, t=4, h=16, c=512, r=64, s=500, kv_len=(500, 1, 0, 129), dtype=torch.bfloat16),
    "h16-t16": make_case(43, t=16, h=16, c=512, r=64, s=300, kv_len=(0, 300, 127), dtype=torch.bfloat16),
    "h16-t5-partial-rows": make_case(44, t=5, h=16, c=512, r=64, s=260, kv_len=(260, 77), dtype=torch.bfloat16),
    "h128-t1-splits3": make_case(45, t=1, h=128, c=512, r=64, s=1000, kv_len=(1000, 517, 0), dtype=torch.bfloat16,
                                 num_splits=3),
}


def test_the_seesaw_kernel_takes_64_rows_or_more_of_deepseek_slots_in_bf16():
    gluon_latent = pytest.importorskip("dcp_compile.ops.gluon_latent")

    def fits(h=16, t=4, c=512, r=64, dtype=torch.bfloat16, s=8):
        q = torch.empty(2, h, t, c + r, dtype=dtype, device="meta")
        latent, rope = torch.empty(2, 1, s, c, dtype=dtype, device="meta"), torch.empty(2, 1, s, r, dtype=dtype)
        return gluon_latent.seesaw_shapes_fit(q, latent, rope.to("meta"))

    assert fits(t=4) and fits(h=128, t=1) and fits(t=16)
    assert not fits(t=3), "48 rows are memory-bound: the split-KV kernel"
    assert not fits(h=63, t=1) and fits(h=64, t=1), "the boundary is H * T = 64"
    assert not fits(dtype=torch.float16) and not fits(dtype=torch.float32)
    assert not fits(c=256, r=64) and not fits(c=512, r=32)


def test_the_seesaw_grid_is_64_rows_a_program_and_one_program_an_sm():
    gluon_latent = pytest.importorskip("dcp_compile.ops.gluon_latent")

    args, _ = SEESAW_CASES["h128-t1"]  # CPU tensors: the default SM count (132)
    assert gluon_latent.seesaw_grid(args["q"], args["latent"]) == (2, 6, 4), "700 slots: 6 pairs' worth of slices"
    q, latent = torch.empty(8, 16, 4, 576, device="meta"), torch.empty(8, 1, 32768, 512, device="meta")
    assert gluon_latent.seesaw_grid(q, latent) == (1, 16, 8), "B=8, H=16, T=4: 8 x 16 programs"
    assert gluon_latent.seesaw_grid(args["q"], args["latent"], num_splits=3) == (2, 3, 4)


def test_tile_overrides_and_cpu_tensors_take_the_split_kernel():
    from dcp_compile.ops.triton_latent import latent_prefix_kernel

    args, _ = SEESAW_CASES["h128-t1"]
    assert latent_prefix_kernel(args["q"], args["latent"], args["rope"], {}) == "split"  # CPU tensors
    assert latent_prefix_kernel(args["q"], args["latent"], args["rope"], {"num_stages": 2}) == "split"


def slice_partials(seed):
    """Slices' outputs in float64 (rows of very different magnitudes, one past fp16's
    range), their lses (some slices saw nothing, one row nothing anywhere), and the forms
    the seesaw kernel writes: fp16 over each value half's largest magnitude, and fp32."""
    gen = torch.Generator().manual_seed(seed)
    rows, splits = 6, 5
    magnitude = torch.tensor([1e-3, 1.0, 1e5, 3e6, 1.0, 1.0], dtype=torch.float64)[:, None, None]
    o = torch.randn(rows, splits, 512, generator=gen, dtype=torch.float64) * magnitude
    lse = torch.randn(rows, splits, generator=gen, dtype=torch.float64) * 4
    lse[1, 2], lse[4, :], lse[5, 1:] = float("-inf"), float("-inf"), float("-inf")
    o[lse == float("-inf")] = 0.0  # a slice that saw nothing writes zeros
    halves = o.view(rows, splits, 2, 256)
    amax = halves.abs().amax(-1)
    o16 = (halves / amax.clamp_min(1e-300)[..., None]).view(rows, splits, 512).half()
    forms = dict(fp16=dict(o_part=o16, scale_part=amax.float(), lse_part=lse.float()),
                 fp32=dict(o_part=o.float(), scale_part=None, lse_part=lse.float()),
                 one_slice=dict(o_part=o[:, :1].float().contiguous(), scale_part=None,
                                lse_part=lse[:, :1].float().contiguous()))
    return o, lse, forms


def test_the_seesaw_kernels_partials_take_the_form_asked_for_and_refuse_others():
    gluon_latent = pytest.importorskip("dcp_compile.ops.gluon_latent")

    q = torch.empty(2, 16, 4, 576, dtype=torch.bfloat16, device="meta")  # 128 rows
    o_part, scale_part, lse_part = gluon_latent._seesaw_outputs(q, 5, "fp16")
    assert (o_part.dtype, o_part.shape) == (torch.float16, (128, 5, 512))
    assert (scale_part.dtype, scale_part.shape) == (torch.float32, (128, 5, 2)) and lse_part.shape == (128, 5)
    o_part, scale_part, _ = gluon_latent._seesaw_outputs(q, 5, "fp32")
    assert o_part.dtype == torch.float32 and scale_part is None
    o_part, scale_part, _ = gluon_latent._seesaw_outputs(q, 1, "fp16")
    assert o_part.dtype == torch.float32 and scale_part is None, "one slice writes the answer itself, in fp32"
    with pytest.raises(ValueError, match=r"partials must be one of \('fp16', 'fp32'\), got 'bf16'"):
        gluon_latent._seesaw_outputs(q, 5, "bf16")


def test_the_seesaw_merge_folds_fp16_and_fp32_partials_like_float64(tmp_path):
    """The merge of the seesaw kernel's slices, under Triton's interpreter: fp16 partials
    over their row's largest magnitude are off by at most 2^-11 of it (a row at 3e6 would
    be inf as plain fp16), fp32 ones by float32's rounding, one slice is the answer."""
    o, lse, forms = slice_partials(0)
    assert torch.isinf(o.half()).any(), "the case needs a row past fp16's range"
    torch.save(forms, tmp_path / "cases.pt")
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "cases.pt"), str(tmp_path / "results.pt"),
                           "gluon_latent.merge_slices"], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    results = torch.load(tmp_path / "results.pt")
    for name, (o_ref, lse_ref) in {"fp16": (o, lse), "fp32": (o, lse), "one_slice": (o[:, :1], lse[:, :1])}.items():
        out, merged_lse = results[name]
        top = lse_ref.amax(1)
        w = torch.exp(lse_ref - torch.where(top.isinf(), 0.0, top)[:, None])
        total = w.sum(1)
        want = (w[..., None] * o_ref).sum(1) / total.clamp_min(1e-300)[:, None]
        assert out.shape == (6, 512) and merged_lse.shape == (6,)
        assert (out[4] == 0).all() and merged_lse[4] == float("-inf"), "a row no slice saw: 0 and -inf"
        allowed = 2.0**-11 if name == "fp16" else 1e-6
        row_max = o_ref.abs().amax((1, 2))
        assert ((out.double() - want).abs() <= allowed * row_max[:, None]).all(), name
        seen = total > 0
        torch.testing.assert_close(merged_lse.double()[seen], (top + total.log())[seen], atol=1e-5, rtol=1e-6)


def test_the_seesaw_kernel_compiles_for_hopper_without_spills_in_both_forms_of_partials():
    """On CPU, for sm_90a (Triton's ptxas), the kernel and the merge each form of its
    partials takes: one program an SM needs the kernel to stay within 227 KiB of shared
    memory, and its 255 registers a thread must not spill."""
    pytest.importorskip("dcp_compile.ops.gluon_latent")
    done = subprocess.run([sys.executable, str(WORKER.with_name("compile_sm90.py")), "fp32", "fp16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"compiling for sm_90a failed:\n{done.stderr[-4000:]}"
    reports = json.loads(done.stdout.splitlines()[-1])
    assert sorted(reports) == ["fp16", "fp32"]
    for form, kernels in reports.items():
        assert sorted(kernels) == ["kernel", "merge"], form
        for name, report in kernels.items():
            assert report["shared"] <= 227 * 1024, (form, name, report)
            assert report["spill_stores"] == report["spill_loads"] == 0, (form, name, report)
            assert report["registers"] <= 255, (form, name, report)


def hopper_with_gluon():
    from dcp_compile.ops import triton_latent

    if triton_latent.gluon_latent is None or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the seesaw kernel runs on Hopper, with Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SEESAW_CASES))
def test_seesaw_kernel_matches_float64_reference_on_gpu(name):
    from dcp_compile.ops.triton_latent import latent_prefix_attention_triton, latent_prefix_kernel

    hopper_with_gluon()
    args, (latent, rope) = SEESAW_CASES[name]
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert latent_prefix_kernel(cuda["q"], cuda["latent"], cuda["rope"], {}) == "seesaw"
    out, lse = latent_prefix_attention_triton(**cuda)
    assert_matches_float64(out, lse, args["q"], torch.cat([latent, rope], dim=-1), latent, args["kv_len"], SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("t, kernel", [(3, "split"), (4, "seesaw")])
def test_the_switch_between_the_latent_kernels_at_64_rows_on_gpu(t, kernel):
    """16 heads: 3 tokens (48 rows) stay with the split-KV kernel, 4 (64 rows) take the seesaw
    kernel; the registered op's results match float64 either way."""
    from dcp_compile.ops.triton_latent import latent_prefix_kernel

    hopper_with_gluon()
    args, (latent, rope) = make_case(46 + t, t=t, h=16, c=512, r=64, s=400, kv_len=(400, 0, 200), dtype=torch.bfloat16)
    cuda = {k: v.cuda() for k, v in args.items() if isinstance(v, torch.Tensor)}
    assert latent_prefix_kernel(cuda["q"], cuda["latent"], cuda["rope"], {}) == kernel
    out, lse = torch.ops.dcp.latent_prefix_attention(cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE)
    assert_matches_float64(out, lse, args["q"], torch.cat([latent, rope], dim=-1), latent, args["kv_len"], SCALE)


@pytest.mark.gpu
def test_the_seesaw_kernels_partials_fp16_fp32_and_one_slice_on_gpu():
    """Either form of the slices' partials, and one slice writing the answer itself, match
    float64 (128 heads: two row blocks, 6 slices; NaN past each length); fp16 partials are
    within 2^-11 of the cache's largest magnitude of fp32 ones (each off by at most 2^-12
    of its value half's largest, and the merge averages them)."""
    from dcp_compile.ops import gluon_latent

    hopper_with_gluon()
    args, (latent, rope) = SEESAW_CASES["h128-t1"]
    cuda = {k: v.cuda() for k, v in args.items() if isinstance(v, torch.Tensor)}
    results = {}
    for partials, num_splits in (("fp16", None), ("fp32", None), ("fp16", 1)):
        results[partials, num_splits] = gluon_latent.seesaw_attention(
            cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE, num_splits=num_splits, partials=partials)
        assert_matches_float64(*results[partials, num_splits], args["q"], torch.cat([latent, rope], dim=-1), latent,
                               args["kv_len"], SCALE)
    (out16, lse16), (out32, lse32) = results["fp16", None], results["fp32", None]
    assert (out16 - out32).abs().max().item() <= 2.0**-11 * latent.float().nan_to_num().abs().max().item()
    torch.testing.assert_close(lse16, lse32, atol=1e-6, rtol=1e-6)  # the lses do not pass through fp16


@pytest.mark.gpu
def test_the_seesaw_op_replays_in_a_cuda_graph_with_new_lengths_on_gpu():
    """The op captured once (eight slices of 900 slots, 64 programs), replayed with shorter
    lengths written into its ``kv_len``: float64's answer every time."""
    hopper_with_gluon()
    args, (latent, rope) = make_case(50, t=1, h=128, c=512, r=64, s=900, kv_len=(900, 300, 0, 511),
                                     dtype=torch.bfloat16)
    cuda = {k: v.cuda() for k, v in args.items() if isinstance(v, torch.Tensor)}
    op = torch.ops.dcp.latent_prefix_attention_gluon
    op(cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op(cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE)
    for lengths in ((900, 300, 0, 511), (17, 1, 0, 500), (64, 299, 0, 128), (900, 300, 0, 511)):
        cuda["kv_len"].copy_(torch.tensor(lengths))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_float64(out, lse, args["q"], torch.cat([latent, rope], dim=-1), latent, torch.tensor(lengths),
                               SCALE)


@pytest.mark.gpu
def test_the_seesaw_kernels_phase_stamps_are_in_order_on_gpu():
    """The experiments' timer hook: every program stamps its start, q's arrival, its loop's
    end and its stores' end, in that order, within one launch."""
    from dcp_compile.ops import gluon_latent

    hopper_with_gluon()
    args, _ = SEESAW_CASES["h128-t1"]  # 4 sequences, 2 row blocks, 6 slices: 48 programs
    cuda = {k: v.cuda() for k, v in args.items() if isinstance(v, torch.Tensor)}
    assert gluon_latent.seesaw_grid(cuda["q"], cuda["latent"]) == (2, 6, 4)
    with pytest.raises(ValueError, match="48 programs"):
        gluon_latent.seesaw_attention(cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE,
                                      times=torch.zeros(47, 4, dtype=torch.int64, device="cuda"))
    times = torch.zeros(48, 4, dtype=torch.int64, device="cuda")
    gluon_latent.seesaw_attention(cuda["q"], cuda["latent"], cuda["rope"], cuda["kv_len"], SCALE, times=times)
    stamps = times.cpu()
    assert (stamps > 0).all(), "a program did not stamp every phase"
    assert (stamps.diff(dim=1) >= 0).all()
    assert stamps[:, 3].max() - stamps[:, 0].min() < 10**9, "one launch, well under a second"


def make_window_case(seed, *, t=4, h=4, c=32, r=16, positions=None, dtype=torch.float32, **tiles):
    """The latent window: the new tokens' latent and rope key, causal by global position."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(positions if positions is not None else [[5 + i for i in range(t)], list(range(t))])
    b = positions.shape[0]
    q = torch.randn(b, h, t, c + r, generator=gen).to(dtype)
    latent = torch.randn(b, 1, t, c, generator=gen).to(dtype)
    rope = torch.randn(b, 1, t, r, generator=gen).to(dtype)
    return dict(q=q, latent=latent, rope=rope, positions=positions, scale=SCALE, **tiles)


WINDOW_CASES = {
    "decode-fp32": make_window_case(20, t=1, positions=[[7], [0], [31]]),
    "verify-fp32": make_window_case(21, t=4),
    "verify-bf16": make_window_case(22, t=4, dtype=torch.bfloat16),
    # positions need not be consecutive or increasing: a token sees what its position allows
    "shuffled-fp32": make_window_case(23, t=5, positions=[[9, 3, 7, 3, 12], [0, 1, 2, 3, 4]]),
    "h16-t16-bf16": make_window_case(24, t=16, h=16, c=512, r=64, positions=[list(range(40, 56))],
                                     dtype=torch.bfloat16),
    "h128-t2": make_window_case(25, t=2, h=128, positions=[[3, 4], [10, 11]]),
    "h1-t3-rows32": make_window_case(26, t=3, h=1, positions=[[0, 1, 2]], rows=32, num_warps=4),
    # a prefill chunk's window: several blocks of slots, rows that see nothing in a whole block
    "chunk-t100-bf16": make_window_case(27, t=100, h=2, positions=[list(range(300, 400)), list(range(99, -1, -1))],
                                        dtype=torch.bfloat16),
    "chunk-t40-fp32-block16": make_window_case(28, t=40, h=3, positions=[list(range(40))], block_s=16),
    # past 1024 new tokens the scan for the tile's last visible key takes two steps; early
    # tiles of sorted positions stop there, the reversed row's tiles see key 0 and go on
    "chunk-t1100-scan-twice": make_window_case(30, t=1100, h=1, c=16, r=16,
                                               positions=[list(range(1100)), list(range(1099, -1, -1))]),
    # positions as int32 (the graph keeps the caller's dtype)
    "int32-positions": dict(make_window_case(29, t=6, h=4), positions=torch.tensor([[4, 5, 6, 7, 8, 9], [1, 0, 3, 2, 5, 4]],
                                                                                    dtype=torch.int32)),
}


@pytest.fixture(scope="module")
def interpreted_window(tmp_path_factory):
    folder = tmp_path_factory.mktemp("triton_latent_window")
    torch.save(WINDOW_CASES, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "results.pt"),
                           "latent_window_attention_triton"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


def window_float64(args):
    positions = args["positions"]
    keys = torch.cat([args["latent"], args["rope"]], dim=-1)
    allowed = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
    return attention_float64(args["q"], keys, args["latent"], allowed, SCALE)


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_latent_window_kernel_matches_float64_reference(interpreted_window, name):
    from tests.ops.test_triton_prefix import TOLERANCE

    args = WINDOW_CASES[name]
    out, lse = interpreted_window[name]
    ref_out, ref_lse = window_float64(args)
    assert out.shape == ref_out.shape and not torch.isnan(out).any()
    tol = TOLERANCE[args["q"].dtype]
    torch.testing.assert_close(out.double(), ref_out, **tol["out"])
    torch.testing.assert_close(lse.double(), ref_lse, **tol["lse"])


def test_the_latent_window_op_on_cpu_is_the_window_over_the_keys_side_by_side():
    from dcp_compile.ops.attention import latent_window_attention

    args = WINDOW_CASES["shuffled-fp32"]
    out, lse = latent_window_attention(args["q"], args["latent"], args["rope"], args["positions"], SCALE)
    ref_out, ref_lse = window_float64(args)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_the_latent_window_kernel_refuses_a_window_of_another_length():
    from dcp_compile.ops.triton_latent import latent_window_attention_triton

    args = dict(WINDOW_CASES["verify-fp32"])
    args["latent"], args["rope"] = args["latent"][:, :, :3], args["rope"][:, :, :3]
    with pytest.raises(ValueError, match=r"T new tokens in q \[B, H, T, \.\], latent \[B, 1, T, C\]"):
        latent_window_attention_triton(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_latent_window_kernel_matches_float64_reference_on_gpu(name):
    from dcp_compile.ops.triton_latent import latent_window_attention_triton
    from tests.ops.test_triton_prefix import TOLERANCE

    args = WINDOW_CASES[name]
    out, lse = latent_window_attention_triton(**{k: v.cuda() if isinstance(v, torch.Tensor) else v
                                                 for k, v in args.items()})
    ref_out, ref_lse = window_float64(args)
    tol = TOLERANCE[args["q"].dtype]
    torch.testing.assert_close(out.cpu().double(), ref_out, **tol["out"])
    torch.testing.assert_close(lse.cpu().double(), ref_lse, **tol["lse"])
