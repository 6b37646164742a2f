"""Attention written by hand (softmax(q @ k^T * scale + mask) @ v) over KV caches:
found, proven and rewritten like SDPA (its refusals are in test_find)."""

import math

import pytest
import torch

from dcp_compile.layout import KVLayout
from dcp_compile.passes import find, shard_attention
from dcp_compile.passes.shard_attention import ALL_GATHER, PREFIX_ATTENTION, WINDOW_ATTENTION
from tests.passes import graphs
from tests.support import capture_graph


def plan_of(module_cls):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    return gm, find(gm)


def count(gm, predicate):
    return sum(1 for n in gm.graph.nodes if predicate(n))


def is_matmul(node):
    return node.op == "call_function" and getattr(node.target, "__name__", "") in ("matmul", "bmm")


@pytest.mark.parametrize("module_cls, scale", [
    (graphs.HandWrittenGptFast, 1 / math.sqrt(graphs.D)),
    (graphs.HandWrittenHFEager, graphs.D**-0.5),
])
def test_hand_written_attention_is_a_site_and_is_rewritten(module_cls, scale):
    gm, plan = plan_of(module_cls)
    (site,) = plan.sites
    assert site.mask.proven, site.mask.failure
    assert site.scale == pytest.approx(scale)
    assert is_matmul(site.node) and tuple(site.query.meta["example_value"].shape) == (graphs.B, graphs.HQ, 3, graphs.D)
    assert count(gm, is_matmul) == 2 and count(gm, lambda n: n.target is ALL_GATHER) == 0
    shard_attention(gm, plan, layout=KVLayout(2, 0, graphs.S), group_name="g")
    # scores, softmax and the value product are gone with the full-cache reads
    assert count(gm, is_matmul) == 0
    assert count(gm, lambda n: "softmax" in str(n.target)) == 0
    assert count(gm, lambda n: n.target is ALL_GATHER) == 1
    assert count(gm, lambda n: n.target is PREFIX_ATTENTION) == 1 and count(gm, lambda n: n.target is WINDOW_ATTENTION) == 1


def test_an_unmasked_hand_written_attention_is_found_but_not_proven():
    _, plan = plan_of(graphs.MatmulOverCache)
    (site,) = plan.sites
    assert not site.mask.proven and "has no mask" in site.mask.failure
    assert f"graphs.py:{graphs.line_of('UNMASKED-MATMUL')}" in site.mask.failure


def test_hand_written_attention_over_tensors_of_the_step_is_left_alone():
    class NoCacheByHand(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    q = torch.randn(graphs.B, graphs.HQ, 3, graphs.D)
    gm, _ = capture_graph(NoCacheByHand(), q, q.clone(), q.clone())
    before = [n.target for n in gm.graph.nodes]
    plan = find(gm)
    assert plan.sites == () and plan.caches == ()
    assert [n.target for n in gm.graph.nodes] == before
