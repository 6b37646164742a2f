import itertools

import pytest
import torch

from dcp_compile.layout import KVLayout
from dcp_compile.ops import attention_with_lse, lse_merge, prefix_attention, window_attention


def attention_float64(q, k, v, allowed, scale):
    """Independent reference: explicit GQA replication and masked softmax in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)))
    return probs @ v, lse


def qkv(b=2, hq=4, hkv=2, t=3, s=11, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, t, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_attention_with_lse_matches_float64(hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv)
    allowed = torch.rand(2, 3, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    out, lse = attention_with_lse(q, k, v, allowed, 0.35)
    ref_out, ref_lse = attention_float64(q, k, v, allowed, 0.35)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_rows_with_no_key_give_zero_and_minus_inf():
    q, k, v = qkv()
    allowed = torch.ones(2, 3, 11, dtype=torch.bool)
    allowed[1, 2] = False
    out, lse = attention_with_lse(q, k, v, allowed, 0.35)
    assert (out[1, :, 2] == 0).all() and (lse[1, :, 2] == float("-inf")).all()
    assert not torch.isnan(out).any()


def test_prefix_attention_reads_only_slots_below_length():
    q, k, v = qkv()
    kv_len = torch.tensor([4, 0])
    out, lse = prefix_attention(q, k, v, kv_len, 0.35)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[0, :, 4:], poisoned_v[0, :, 4:] = float("nan"), float("nan")
    poisoned_k[1], poisoned_v[1] = float("nan"), float("nan")
    out2, lse2 = prefix_attention(q, poisoned_k, poisoned_v, kv_len, 0.35)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert (lse[1] == float("-inf")).all() and (out[1] == 0).all()
    slots = torch.arange(11)
    ref_out, ref_lse = attention_float64(q[:1], k[:1], v[:1], (slots < 4).expand(1, 3, 11), 0.35)
    torch.testing.assert_close(out[:1].double(), ref_out, rtol=1e-5, atol=1e-5)


def test_prefix_attention_op_registration():
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.dcp.prefix_attention.default, (q, k, v, torch.tensor([4, 7]), 0.35))


@pytest.mark.parametrize("size,interleave,tokens", list(itertools.product((1, 2, 3, 4), (1, 2), (1, 4))))
def test_cascade_equals_full_causal_attention(size, interleave, tokens):
    """merge(prefix on every rank's shard, window) == causal attention over prefix ++ window."""
    gen = torch.Generator().manual_seed(size * 10 + tokens)
    batch, hq, hkv, d, max_len = 3, 4, 2, 8, 40
    starts = torch.tensor([0, 7, 29])
    keys = torch.randn(batch, hkv, max_len, d, generator=gen)
    values = torch.randn(batch, hkv, max_len, d, generator=gen)
    q = torch.randn(batch, hq, tokens, d, generator=gen)
    positions = starts[:, None] + torch.arange(tokens)
    rows = torch.arange(batch)[:, None]
    k_new, v_new = keys[rows, :, positions].transpose(1, 2), values[rows, :, positions].transpose(1, 2)

    partials = []
    for rank in range(size):
        layout = KVLayout(size, rank, max_len, interleave)
        slot_positions = layout.global_position(torch.arange(layout.local_capacity)).clamp(max=max_len - 1)
        local_k, local_v = keys[:, :, slot_positions], values[:, :, slot_positions]
        kv_len = layout.local_length(starts)
        partials.append(prefix_attention(q, local_k, local_v, kv_len, 0.3))
    partials.append(window_attention(q, k_new, v_new, positions, 0.3))
    out, lse = lse_merge(torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))

    key_pos = torch.arange(max_len)
    allowed = key_pos[None, None, :] <= positions[:, :, None]
    ref_out, ref_lse = attention_float64(q, keys, values, allowed, 0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
