"""The window attention under a tree (ancestor) mask, against float64.

A tree verify's ``T`` nodes attend to each other under ``ancestors [B, T, T]``: node
``t`` sees its ancestors and itself, whatever the positions say (siblings share the
position ``last accepted + depth``).  The cases are random trees (``parent[i] < i``),
GQA and MHA, ``T`` of 1, 5, 24 and 64, fp32 and bf16, plus:

- the chain (``ancestors`` lower-triangular), which must give bitwise today's causal
  result: ``topk = 1`` is the chain at op level;
- a forest of single nodes (each row sees only itself: out is its own value);
- padding nodes no row sees (a tree narrower than the verify width), whose rows give
  ``out = 0``, ``lse = -inf`` and whose keys and values hold NaN;
- a leak check: keys a path's rows may not see hold huge values, and those rows must
  come out bitwise as with clean keys;
- the left-padding bound together with the mask (pads hold NaN).

The CPU blocked kernel (the op's default kernel) runs here; the Triton flash kernel in
its window form runs under Triton's interpreter, every case in one spawned process, and
for real with ``pytest -m gpu``.
"""

import functools
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

from dcp_compile.ops import attention
from dcp_compile.ops.triton_flash import window_flash_triton
from tests.ops.test_triton_flash import _calls, check_against_reference

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import sys, torch
from tests.ops.triton_interpret import patch_interpreter
patch_interpreter()
import dcp_compile.ops
cases = torch.load(sys.argv[1])
torch.save({name: dcp_compile.ops.window_flash_triton(**args) for name, args in cases.items()}, sys.argv[2])
"""
SCALE = 0.2
FP32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
# lse accumulates exact products of the rounded inputs in fp32 whatever the dtype; a
# 16-bit out is bounded by how far an independent 16-bit reference is from float64.
LSE_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
SMALL = {"block_m": 16, "block_n": 16}
WIDTHS = (1, 5, 24, 64)
HEADS = {"gqa": (8, 2), "mha": (4, 4)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def random_parents(gen: torch.Generator, t: int) -> list[int]:
    """A random tree of ``t`` nodes in topological order: node 0 the root, ``parent[i] < i``."""
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, t)]


def chain_parents(t: int) -> list[int]:
    return list(range(-1, t - 1))


def tree_mask(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ancestors [T, T] bool, depth [T])``: the transitive closure of ``parent``, self
    included, and each node's distance from its root."""
    t = len(parents)
    ancestors = torch.eye(t, dtype=torch.bool)
    depth = torch.zeros(t, dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestors[i] |= ancestors[p]
            depth[i] = depth[p] + 1
    return ancestors, depth


def tree_case(seed, trees, *, hq=8, hkv=2, d=16, dtype=torch.float32, starts=None, lower=None, blocks=SMALL):
    """``window_flash_triton`` arguments for one tree per sequence (``trees``: a parent
    list each), positions ``start_b + depth``, and the allowed mask ``[B, T, T]``.
    ``lower``: a left-padding bound, with NaN in the keys and values below it."""
    gen = torch.Generator().manual_seed(seed)
    masks, depths = zip(*(tree_mask(p) for p in trees))
    ancestors, depth = torch.stack(masks), torch.stack(depths)
    b, t = depth.shape
    starts = torch.tensor(starts if starts is not None else [7 * i + 3 for i in range(b)])
    positions = starts[:, None] + depth
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, t, d, generator=gen).to(dtype) for _ in range(2))
    allowed = ancestors.clone()
    args = dict(q=q, k_new=k, v_new=v, positions=positions, scale=SCALE, ancestors=ancestors, **blocks)
    if lower is not None:
        lower = torch.tensor(lower)
        pad = positions < lower[:, None]
        allowed &= ~pad[:, None, :]
        hide = pad[:, None, :, None]
        args.update(k_new=k.masked_fill(hide, float("nan")), v_new=v.masked_fill(hide, float("nan")), lower=lower)
    return args, allowed


def random_case(seed, t, heads="gqa", dtype="fp32", batch=2, **kw):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = HEADS[heads]
    return tree_case(seed, [random_parents(gen, t) for _ in range(batch)], hq=hq, hkv=hkv, dtype=DTYPES[dtype], **kw)


def with_padding_nodes(args, allowed, unused):
    """Nodes ``unused [B, T]`` out of the tree: no row sees them, their own rows see
    nothing, and their keys and values hold NaN."""
    hide = unused[:, None, :, None]
    ancestors = args["ancestors"] & ~unused[:, None, :] & ~unused[:, :, None]
    k, v = (x.masked_fill(hide, float("nan")) for x in (args["k_new"], args["v_new"]))
    return dict(args, k_new=k, v_new=v, ancestors=ancestors), allowed & ancestors


def poisoned_off_path(args, leaves):
    """The keys and values outside the path to ``leaves[b]`` scaled to huge values: the
    rows on the path (which see only path nodes) must not notice."""
    off_path = ~torch.stack([args["ancestors"][b, leaf] for b, leaf in enumerate(leaves)])  # [B, T]
    hide = off_path[:, None, :, None]
    k = torch.where(hide, args["k_new"] * 1e3, args["k_new"])
    v = torch.where(hide, args["v_new"] * 1e6, args["v_new"])
    return dict(args, k_new=k, v_new=v), ~off_path


def op_args(args):
    """The op's own arguments (the block overrides are the Triton op's)."""
    return {key: value for key, value in args.items() if key not in ("block_m", "block_n")}


def build_cases():
    """Name -> ``(window_flash_triton arguments, allowed mask)``."""
    cases = {}
    for t in WIDTHS:
        for heads in HEADS:
            for dtype in DTYPES:
                cases[f"tree-t{t}-{heads}-{dtype}"] = random_case(100 + t, t, heads, dtype)
    # the tiles a GPU gets (128 query rows, 64-key blocks)
    cases["tree-t64-default-tiles"] = random_case(7, 64, blocks={})
    cases["tree-t24-default-tiles-bf16"] = random_case(8, 24, dtype="bf16", blocks={})
    cases["chain"] = tree_case(9, [chain_parents(24)] * 3)
    chain, allowed = cases["chain"]
    cases["causal"] = ({key: value for key, value in chain.items() if key != "ancestors"}, allowed)
    cases["forest"] = tree_case(10, [[-1] * 24] * 2)
    args, allowed = random_case(11, 40)
    unused = torch.zeros(2, 40, dtype=torch.bool)
    unused[0, 33:] = True  # the tree ends before the width
    unused[1, 20:24] = True  # and a block of 16 keys no row sees
    unused[1, 26:] = True
    cases["padding-nodes"] = with_padding_nodes(args, allowed, unused)
    cases["clean"] = random_case(12, 37)
    leaves = [int(cases["clean"][0]["ancestors"][b].sum(-1).argmax()) for b in range(2)]  # a deepest node
    cases["poisoned"] = (poisoned_off_path(cases["clean"][0], leaves)[0], cases["clean"][1])
    # a bound below every node, at a middle depth, and past the deepest node
    cases["lower"] = random_case(13, 30, batch=3, starts=(10, 10, 10), lower=(0, 12, 100))
    return cases, leaves


CASES, LEAVES = build_cases()
MEASURED = [name for name in CASES if name != "poisoned"]
"""Cases compared with float64 (the poisoned one's huge values are there for the leak check)."""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tree_window")
    torch.save({name: args for name, (args, _) in CASES.items()}, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder / "cases.pt"), str(folder / "results.pt")],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(folder / "results.pt")


def cpu_op(args):
    return torch.ops.dcp.window_attention(**op_args(args))


# --- the CPU blocked kernel (the op's default kernel, the reference) -----------------------------


@pytest.mark.parametrize("name", MEASURED)
def test_cpu_kernel_matches_float64(name):
    args, allowed = CASES[name]
    check_against_reference(*cpu_op(args), args, allowed)


def test_cpu_kernel_reads_the_mask_tile_by_tile():
    """16 x 16 tiles: a tree of 64 nodes crosses query and key blocks, and each tile reads
    its own slice of the mask."""
    args, allowed = random_case(20, 64)
    small = functools.partial(attention.blocked_attention, query_block=16, key_block=16)
    with mock.patch.object(attention, "blocked_attention", small):
        out, lse = cpu_op(args)
    check_against_reference(out, lse, args, allowed)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("t", WIDTHS)
def test_cpu_chain_is_the_causal_window_bitwise(t, dtype):
    """``topk = 1``: the chain's ancestor mask is the causal one, and the results are the same bits."""
    args, _ = tree_case(30 + t, [chain_parents(t)] * 2, dtype=DTYPES[dtype])
    causal = {key: value for key, value in op_args(args).items() if key != "ancestors"}
    assert torch.equal(args["ancestors"][0], torch.ones(t, t, dtype=torch.bool).tril())
    tree_out, tree_lse = cpu_op(args)
    out, lse = torch.ops.dcp.window_attention(**causal)
    assert torch.equal(tree_out, out) and torch.equal(tree_lse, lse)


def test_cpu_rows_that_see_only_themselves_are_their_own_values():
    args, _ = CASES["forest"]
    out, lse = cpu_op(args)
    group = args["q"].shape[1] // args["k_new"].shape[1]
    assert torch.equal(out, args["v_new"].repeat_interleave(group, dim=1))
    k = args["k_new"].repeat_interleave(group, dim=1)
    torch.testing.assert_close(lse, (args["q"] * k).sum(-1) * SCALE, **FP32_TOLERANCE)


def test_cpu_rows_on_a_path_ignore_the_keys_off_it():
    clean, poisoned = cpu_op(CASES["clean"][0]), cpu_op(CASES["poisoned"][0])
    _, path = poisoned_off_path(CASES["clean"][0], LEAVES)
    assert path.sum() > 2 and (~path).any()
    for b in range(2):
        for x, y in zip(clean, poisoned):
            assert torch.equal(x[b][:, path[b]], y[b][:, path[b]])
    assert not torch.isnan(poisoned[0]).any()


# --- the Triton window kernel, under the interpreter ---------------------------------------------


@pytest.mark.parametrize("name", MEASURED)
def test_triton_kernel_matches_float64(interpreted, name):
    args, allowed = CASES[name]
    check_against_reference(*interpreted[name], args, allowed)


@pytest.mark.parametrize("name", [n for n in MEASURED if CASES[n][0]["q"].dtype == torch.float32])
def test_triton_kernel_agrees_with_the_cpu_kernel(interpreted, name):
    out, lse = interpreted[name]
    ref_out, ref_lse = cpu_op(CASES[name][0])
    torch.testing.assert_close(out, ref_out, **FP32_TOLERANCE)
    torch.testing.assert_close(lse, ref_lse, **FP32_TOLERANCE)


def test_triton_rows_on_a_path_ignore_the_keys_off_it(interpreted):
    clean, poisoned = interpreted["clean"], interpreted["poisoned"]
    _, path = poisoned_off_path(CASES["clean"][0], LEAVES)
    for b in range(2):
        for x, y in zip(clean, poisoned):
            assert torch.equal(x[b][:, path[b]], y[b][:, path[b]])
    assert not torch.isnan(poisoned[0]).any()


def test_triton_chain_is_the_causal_window_bitwise(interpreted):
    (tree_out, tree_lse), (out, lse) = interpreted["chain"], interpreted["causal"]
    assert torch.equal(tree_out, out) and torch.equal(tree_lse, lse)


def test_triton_rows_that_see_only_themselves_are_their_own_values(interpreted):
    args, _ = CASES["forest"]
    group = args["q"].shape[1] // args["k_new"].shape[1]
    torch.testing.assert_close(interpreted["forest"][0], args["v_new"].repeat_interleave(group, dim=1),
                               atol=0, rtol=0)


# --- bad input, the schema, the compiled graphs --------------------------------------------------


def _bad(**change):
    args, _ = random_case(0, 5)
    return {**op_args(args), **change}


BAD = {
    "int64": (lambda: _bad(ancestors=torch.ones(2, 5, 5, dtype=torch.long)), r"bool tensor \[B, T, T\] = \[2, 5, 5\]"),
    "no-batch": (lambda: _bad(ancestors=torch.ones(5, 5, dtype=torch.bool)), r"got torch.bool \(5, 5\)"),
    "wide": (lambda: _bad(ancestors=torch.ones(2, 5, 6, dtype=torch.bool)), r"\[2, 5, 5\].*\(2, 5, 6\)"),
    "device": (lambda: _bad(ancestors=torch.ones(2, 5, 5, dtype=torch.bool, device="meta")),
               r"one device, got cpu and meta; move ancestors"),
}


@pytest.mark.parametrize("call", ["op", "triton"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_ancestors_are_refused_with_what_was_expected(name, call):
    make, match = BAD[name]
    args = make()
    run = torch.ops.dcp.window_attention if call == "op" else window_flash_triton
    with pytest.raises(ValueError, match=match):
        run(**args)


def test_the_schema_takes_the_mask_last_and_optional():
    schema = torch.ops.dcp.window_attention.default._schema
    assert [a.name for a in schema.arguments][-2:] == ["lower", "ancestors"]
    assert str(schema.arguments[-1].type) == "Optional[Tensor]" and schema.arguments[-1].default_value is None


def _trace_with_ancestors(device: str, t: int = 24):
    """The graph AOTAutograd hands its backend for one window call with a tree mask."""
    with FakeTensorMode():
        q = torch.empty(2, 8, t, 64, device=device, dtype=torch.bfloat16)
        kv = torch.empty(2, 2, t, 64, device=device, dtype=torch.bfloat16)
        positions = torch.empty(2, t, device=device, dtype=torch.int64)
        ancestors = torch.empty(2, t, t, device=device, dtype=torch.bool)

    def f(q, k, v, positions, ancestors):
        return torch.ops.dcp.window_attention(q, k, v, positions, SCALE, None, ancestors)

    return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, kv, kv, positions, ancestors)


def test_compiled_cuda_graph_takes_the_mask_to_the_triton_kernel():
    gm = _trace_with_ancestors("cuda")
    calls = _calls(gm)
    assert "dcp.window_attention.default" not in calls and "_flash_fwd_kernel" in calls
    mask = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    launch = next(n for n in gm.graph.nodes if "kernel_idx" in n.kwargs)
    reads_mask = {mask, *mask.users}  # the launch reads the mask, or its int8 view
    assert reads_mask & set(launch.all_input_nodes)


def test_compiled_cpu_graph_keeps_the_reference_op_with_the_mask():
    gm = _trace_with_ancestors("cpu")
    call = next(n for n in gm.graph.nodes if str(n.target) == "dcp.window_attention.default")
    mask = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    assert mask in call.all_input_nodes


def test_a_bad_mask_fails_at_trace_time():
    with FakeTensorMode():
        q = torch.empty(2, 8, 5, 64)
        kv = torch.empty(2, 2, 5, 64)
        positions = torch.empty(2, 5, dtype=torch.int64)
        ancestors = torch.empty(2, 5, 4, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"ancestors must be a bool tensor \[B, T, T\] = \[2, 5, 5\]"):
            torch.ops.dcp.window_attention(q, kv, kv, positions, SCALE, None, ancestors)


# --- the same on a GPU ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(args):
    return {key: a.cuda() if isinstance(a, torch.Tensor) else a for key, a in args.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", MEASURED)
def test_triton_kernel_matches_float64_on_gpu(name):
    args, allowed = CASES[name]
    out, lse = (x.cpu() for x in window_flash_triton(**_cuda(args)))
    check_against_reference(out, lse, args, allowed)


@pytest.mark.gpu
@needs_cuda
def test_inductor_takes_the_mask_to_the_kernel_on_gpu():
    from torch._inductor.utils import run_and_get_code

    args, allowed = random_case(40, 64, dtype="bf16")
    cuda = _cuda(op_args(args))

    def step(q, k, v, positions, ancestors):
        return torch.ops.dcp.window_attention(q, k, v, positions, SCALE, None, ancestors)

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    (out, lse), code = run_and_get_code(compiled, *(cuda[n] for n in ("q", "k_new", "v_new", "positions", "ancestors")))
    assert "_flash_fwd_kernel" in "\n".join(code) and "dcp.window_attention" not in "\n".join(code)
    check_against_reference(out.cpu(), lse.cpu(), args, allowed)
