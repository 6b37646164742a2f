"""DeepSeek's own MLA decode code (``inference/model.py``, the absorbed branch), kept as a
small copy of its idioms: the caches written through Python-int slices
``kv_cache[:bsz, start_pos:end_pos]``, read as ``kv_cache[:bsz, :end_pos]``, an additive
mask for the prompt.  Compiled as it is, it is refused with its line and the fix; written
with position tensors as the error says, it compiles through ``dcp.backend`` and decodes
what DeepSeek's code decodes."""

import pytest
import torch
from torch import nn

import dcp_compile as dcp
from dcp_compile.passes import GraphPatternError

B, S, DIM, HEADS, NOPE, ROPE, V, LORA = 2, 32, 32, 4, 8, 4, 8, 16


class DeepSeekMLA(nn.Module):
    """The absorbed decode branch of DeepSeek-V3's ``MLA.forward`` (rotary embedding
    left out: it acts on ``q_pe`` and ``k_pe`` before the caches, the same in both forms)."""

    def __init__(self):
        super().__init__()
        self.n_local_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = HEADS, NOPE, ROPE, V
        self.kv_lora_rank = LORA
        self.wq = nn.Linear(DIM, HEADS * (NOPE + ROPE), bias=False)
        self.wkv_a = nn.Linear(DIM, LORA + ROPE, bias=False)
        self.kv_norm = nn.RMSNorm(LORA, eps=1e-6)
        self.wkv_b = nn.Linear(LORA, HEADS * (NOPE + V), bias=False)
        self.wo = nn.Linear(HEADS * V, DIM, bias=False)
        self.softmax_scale = (NOPE + ROPE) ** -0.5
        self.register_buffer("kv_cache", torch.zeros(B, S, LORA), persistent=False)
        self.register_buffer("pe_cache", torch.zeros(B, S, ROPE), persistent=False)

    def project(self, x):
        bsz, seqlen, _ = x.size()
        q = self.wq(x).view(bsz, seqlen, self.n_local_heads, NOPE + ROPE)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2)
        wkv_b = self.wkv_b.weight.view(self.n_local_heads, -1, self.kv_lora_rank)
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :self.qk_nope_head_dim])
        return q_nope, q_pe, self.kv_norm(kv), k_pe, wkv_b

    def forward(self, x, start_pos: int, mask=None):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q_nope, q_pe, kv, k_pe, wkv_b = self.project(x)
        self.kv_cache[:bsz, start_pos:end_pos] = kv  # CACHE WRITE
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
        scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:bsz, :end_pos]) +
                  torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos])) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,btc->bshc", scores, self.kv_cache[:bsz, :end_pos])
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim:])
        return self.wo(x.flatten(2))


class WithPositions(DeepSeekMLA):
    """The same attention as the error's fix spells it: positions as a tensor, the whole
    cache read under ``slot <= position`` (the slots counted from the cache's own length,
    which is this rank's share once the cache is sharded)."""

    def forward(self, x, positions):
        bsz, seqlen, _ = x.size()
        q_nope, q_pe, kv, k_pe, wkv_b = self.project(x)
        rows = torch.arange(bsz)[:, None]
        self.kv_cache[rows, positions] = kv
        self.pe_cache[rows, positions] = k_pe.squeeze(2)
        scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache) +
                  torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache)) * self.softmax_scale
        visible = torch.arange(self.slots())[None, None, None, :] <= positions[:, :, None, None]
        scores = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,btc->bshc", scores, self.kv_cache)
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim:])
        return self.wo(x.flatten(2))

    def slots(self) -> int:
        return self.kv_cache.shape[1]


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


def test_deepseeks_slice_writes_are_refused_with_the_line_and_the_fix():
    model = DeepSeekMLA().eval()
    group = dcp.DCPGroup(1, 0, torch.device("cpu"), None)
    x = torch.randn(B, 1, DIM)
    with pytest.raises(GraphPatternError) as refusal:
        dcp.prepare(model, group, "target", max_batch=B, max_seq_len=S, example_inputs=(x, 5))
        compiled = torch.compile(model, backend=dcp.backend(group, "target", lowering="aot_eager"), fullgraph=True,
                                 dynamic=False)
        with torch.no_grad():
            compiled(x, 5)
    message = str(refusal.value)
    assert f"test_deepseek_idiom.py:{line_of('# CACHE WRITE')}" in message
    assert "slice(5, 6, None)" in message, "the entry named is the positions' slice, not the covering [:bsz]"
    assert "pass the positions as a [B, T] tensor" in message


def decode_against_deepseek(group, cascade=False) -> dict:
    """DeepSeek's code eagerly (a 5-token prompt under its triu mask, then 4 decode steps)
    and the positions form compiled by ``dcp.backend`` on ``group``: the largest output
    difference, and what the backend found."""
    torch.manual_seed(0)
    reference = DeepSeekMLA().eval()
    model = WithPositions().eval()
    model.load_state_dict(reference.state_dict())
    prompt = torch.randn(B, 5, DIM)
    dcp.prepare(model, group, "target", max_batch=B, max_seq_len=S,
                example_inputs=(prompt, torch.arange(5).expand(B, 5).contiguous()))
    # prepare's trial forward runs on fake tensors: the caches hold what prepare laid out, zeros
    untouched = bool((model.kv_cache == 0).all() and (model.pe_cache == 0).all())
    backend = dcp.backend(group, "target", lowering="aot_eager", cascade=cascade)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    mask = torch.full((5, 5), float("-inf")).triu_(1)
    with torch.no_grad():
        differences = [(compiled(prompt, torch.arange(5).expand(B, 5).contiguous()) - reference(prompt, 0, mask)).abs().max()]
        for step in range(5, 9):
            x = torch.randn(B, 1, DIM)
            differences.append((compiled(x, torch.full((B, 1), step)) - reference(x, step)).abs().max())
    return dict(difference=float(max(differences)), untouched_by_prepare=untouched, latent_sites=[sum(s.latent is not None for s in c.plan.sites)
                                                                  for c in backend.compiled],
                collectives=backend.collective_counts)


def deepseek_worker(rank, size):
    return decode_against_deepseek(dcp.init_group("cpu"))


class MaskOfMaxSeqLen(WithPositions):
    """The fix with one slip: the mask counts ``S`` slots, a constant, not the cache's own."""

    def slots(self) -> int:
        return S


def mask_of_max_seq_len_worker(rank, size):
    model = MaskOfMaxSeqLen().eval()
    prompt, positions = torch.randn(B, 5, DIM), torch.arange(5).expand(B, 5).contiguous()
    try:
        dcp.prepare(model, dcp.init_group("cpu"), "target", max_batch=B, max_seq_len=S, example_inputs=(prompt, positions))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("cascade", [False, True])
def test_the_fix_compiles_and_decodes_what_deepseeks_code_decodes(cascade):
    """On a group of one (``cascade``: through the prefix + window + merge a DCP rank runs)."""
    result = decode_against_deepseek(dcp.DCPGroup(1, 0, torch.device("cpu"), None), cascade)
    assert result["latent_sites"] == [1, 1], "the prefill and the decode graph: one latent site each"
    assert result["difference"] < 1e-5


def test_the_fix_sharded_over_two_ranks_decodes_what_deepseeks_code_decodes():
    from dcp_compile.runtime.launch import spawn_ranks

    for result in spawn_ranks(deepseek_worker, 2, timeout=600):
        assert result["latent_sites"] == [1, 1] and result["collectives"] == [2, 2]  # an all-gather and its wait
        assert result["difference"] < 1e-5 and result["untouched_by_prepare"]


def test_a_mask_sized_by_max_seq_len_is_refused_at_prepare_with_the_shard_length():
    """Sharded, the cache holds 17 slots (16 owned and the trash slot), and a mask of 32
    no longer broadcasts against it: prepare's trial forward on fake tensors says why."""
    from dcp_compile.runtime.launch import spawn_ranks

    for message in spawn_ranks(mask_of_max_seq_len_worker, 2, timeout=600):
        assert message is not None, "prepare accepted a model whose forward cannot run on its shards"
        assert "Each sharded cache now holds 17 slots, not max_seq_len=32" in message
        assert "torch.arange(self.kv_cache.shape[seq_dim])" in message
