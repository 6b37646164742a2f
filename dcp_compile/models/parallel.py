"""Tensor parallelism for the package's targets (``Llama``, ``MLATransformer``), in place.

Megatron's layout, as DeepSeek's and torchtitan's inference code lay it out:

- attention: the query heads are split T ways (column-parallel ``wq``; MLA's ``wq``/``wq_b``
  and ``wkv_b`` by head), ``wo`` is row-parallel and ends in one all-reduce over the TP
  group;
- GQA keys and values: rank r holds KV heads ``[r*H_kv/T, (r+1)*H_kv/T)`` while T <= H_kv,
  else the one head ``r*H_kv//T`` (each head replicated T/H_kv times);
- MLA: the latent projection ``wkv_a`` and the latent cache stay whole on every rank (one
  latent head cannot be split);
- the MLP: ``w1``/``w3`` column-parallel, ``w2`` row-parallel with one all-reduce;
- the embedding, the norms and the LM head stay whole, so every rank ends each forward
  with the same hidden states and logits: acceptance and sampling run on every rank.

The replicated KV copies are what DCP then shards by token: the D ranks of a DCP group
hold the same KV heads and different query heads (``DCPGroup.heads_split``).  The draft is
never sharded: it reads the target's features after the all-reduce, where they are the
same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from dcp_compile.group import DCPGroup, check_sizes
from dcp_compile.records import record_for
from dcp_compile.models.eagle import EagleDraft
from dcp_compile.models.llama import Attention, DecoderStack, FeedForward
from dcp_compile.models.mla import MLAttention


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's slice of the input features, summed over the TP
    group: ``all_reduce(x_local @ W_local.T)`` (functional collectives, so Dynamo traces
    it into the graph and ``dcp.backend`` leaves it where it is)."""

    def __init__(self, linear: nn.Linear, group_name: str):
        super().__init__()
        self.linear = linear
        self.group_name = group_name

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.linear(x), "sum", self.group_name)


def _rows(linear: nn.Linear, index: torch.Tensor) -> nn.Linear:
    """A linear layer computing only the output features ``index``: column parallel."""
    out = nn.Linear(linear.in_features, len(index), bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[index])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[index])
    return out


def _columns(linear: nn.Linear, index: torch.Tensor, group_name: str) -> RowParallelLinear:
    """A linear layer over the input features ``index``, summed over the TP group."""
    assert linear.bias is None, "the reference models' output projections have no bias"
    out = nn.Linear(len(index), linear.out_features, bias=False, device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, index])
    return RowParallelLinear(out, group_name)


def _heads(first: int, count: int, width: int) -> torch.Tensor:
    """Feature indices of heads ``[first, first + count)`` of ``width`` features each."""
    return torch.arange(first * width, (first + count) * width)


def kv_heads_of(tp_rank: int, tp_size: int, n_kv_heads: int) -> range:
    """The KV heads TP rank ``tp_rank`` holds: its own ``H_kv/T`` while ``T <= H_kv``, else
    the one head ``tp_rank * H_kv // T`` (replicated ``T/H_kv`` times)."""
    if tp_size <= n_kv_heads:
        per = n_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank * n_kv_heads // tp_size
    return range(head, head + 1)


def check_layout(*, n_heads: int, n_kv_heads: int | None, intermediate_size: int, tp: int, dcp: int) -> None:
    """Refuse a model and TP x DCP layout that cannot be laid out, with the rule and the
    numbers (the same verdict on every rank, before any collective). ``n_kv_heads`` None:
    MLA, whose one latent head every rank holds."""
    if n_heads % tp:
        raise ValueError(f"TP size {tp} does not divide the {n_heads} query heads: each rank holds n_heads / T heads; "
                         f"use a TP size that divides {n_heads}")
    if intermediate_size % tp:
        raise ValueError(f"TP size {tp} does not divide the MLP width {intermediate_size}; use one that divides it")
    check_sizes(tp, dcp)
    if n_kv_heads is None:
        return
    if tp <= n_kv_heads:
        if n_kv_heads % tp:
            raise ValueError(f"TP size {tp} does not divide the {n_kv_heads} KV heads; use a TP size that divides "
                             f"{n_kv_heads}, or a multiple of it")
        if dcp > 1:
            raise ValueError(
                f"DCP size {dcp} over TP size {tp} with {n_kv_heads} KV heads: every TP rank holds KV heads of its "
                f"own, so a DCP group would span different KV heads. DCP shards the copies TP leaves: it needs "
                f"D | T/H_kv with T > H_kv (for example --tp {2 * n_kv_heads} --dcp 2)")
        return
    if tp % n_kv_heads:
        raise ValueError(f"TP size {tp} is not a multiple of the {n_kv_heads} KV heads: each KV head must be "
                         f"replicated on T/H_kv ranks")
    copies = tp // n_kv_heads
    if copies % dcp:
        raise ValueError(
            f"DCP size {dcp} does not divide the {copies} copies of each KV head that TP size {tp} leaves over "
            f"{n_kv_heads} KV heads: a DCP group's ranks must hold the same KV heads (D | T/H_kv)")


def _replace_cache(attention: nn.Module, shape: tuple[int, ...]) -> None:
    for name in ("k_cache", "v_cache"):
        old = getattr(attention, name)
        if old is not None:
            attention.register_buffer(name, torch.zeros(shape, dtype=old.dtype, device=old.device), persistent=False)


def _shard_attention(attention: Attention, tp_rank: int, tp: int, group_name: str) -> None:
    cfg, hd = attention.cfg, attention.cfg.head_dim
    local = cfg.n_heads // tp
    kv = kv_heads_of(tp_rank, tp, cfg.n_kv_heads)
    q_index = _heads(tp_rank * local, local, hd)
    kv_index = _heads(kv.start, len(kv), hd)
    attention.wq = _rows(attention.wq, q_index)
    attention.wk, attention.wv = _rows(attention.wk, kv_index), _rows(attention.wv, kv_index)
    attention.wo = _columns(attention.wo, q_index, group_name)
    attention.n_local_heads, attention.n_local_kv_heads = local, len(kv)
    batch, _, seq, _ = attention.cache_shape
    attention.cache_shape = (batch, len(kv), seq, hd)
    _replace_cache(attention, attention.cache_shape)


def _shard_latent_attention(attention: MLAttention, tp_rank: int, tp: int, group_name: str) -> None:
    cfg = attention.cfg
    local = cfg.n_heads // tp
    first = tp_rank * local
    if cfg.q_lora_rank:
        attention.wq_b = _rows(attention.wq_b, _heads(first, local, cfg.qk_head_dim))
    else:
        attention.wq = _rows(attention.wq, _heads(first, local, cfg.qk_head_dim))
    attention.wkv_b = _rows(attention.wkv_b, _heads(first, local, cfg.qk_nope_head_dim + cfg.v_head_dim))
    attention.wo = _columns(attention.wo, _heads(first, local, cfg.v_head_dim), group_name)
    attention.n_local_heads = local


def _shard_mlp(mlp: FeedForward, tp_rank: int, tp: int, group_name: str) -> None:
    width = mlp.w1.out_features // tp
    index = torch.arange(tp_rank * width, (tp_rank + 1) * width)
    mlp.w1, mlp.w3 = _rows(mlp.w1, index), _rows(mlp.w3, index)
    mlp.w2 = _columns(mlp.w2, index, group_name)


def _refuse(model: nn.Module) -> None:
    if isinstance(model, EagleDraft):
        raise ValueError(
            "tensor_parallel was handed an EAGLE draft: drafts stay whole and unsharded on every rank (they read the "
            "target's features after its all-reduce and run no collective). Shard the target only")
    if not isinstance(model, DecoderStack):
        raise TypeError(
            f"tensor_parallel shards the package's own targets (Llama, MLATransformer), not {type(model).__name__}. "
            f"Shard other models with their own TP code (DeepSeek's Column/RowParallelLinear, torch's "
            f"parallelize_module on a DeviceMesh), then dcp.prepare them as usual (docs/tensor-parallel.md)")
    caches = [b for layer in model.layers for b in layer.attention.buffers() if b is not None]
    if any(record_for(b) is not None for b in caches):
        raise ValueError("tensor_parallel after dcp.prepare: prepare laid the caches out for the whole heads. Call "
                         "dcp.tensor_parallel(model, group) first, then dcp.prepare")
    if any(isinstance(layer.attention.wo, RowParallelLinear) for layer in model.layers):
        raise ValueError("this model is already tensor-parallel: call dcp.tensor_parallel once per model")


def shard_in_place(model: DecoderStack, tp_size: int, tp_rank: int, group_name: str = "") -> DecoderStack:
    """Replace ``model``'s projections by TP rank ``tp_rank``'s shards (the layout this
    module's docstring gives); ``group_name``: the TP group the row-parallel layers
    all-reduce over (none is needed on meta, where the memory planner counts bytes)."""
    latent = isinstance(model.layers[0].attention, MLAttention)
    for layer in model.layers:
        if latent:
            _shard_latent_attention(layer.attention, tp_rank, tp_size, group_name)
        else:
            _shard_attention(layer.attention, tp_rank, tp_size, group_name)
        _shard_mlp(layer.feed_forward, tp_rank, tp_size, group_name)
    return model


def tensor_parallel(model: nn.Module, group: DCPGroup) -> nn.Module:
    """Shard ``model`` (a ``Llama`` or ``MLATransformer``) over ``group``'s TP group, in
    place, and return it.  Call it after the weights are loaded and before ``dcp.prepare``.
    Every rank must call it with the same model; a TP group of one leaves the model whole.

    Refused, with the rule and the numbers, on every rank alike: query heads or an MLP
    width that T does not divide, and a DCP group over different KV heads (``D | T/H_kv``
    for GQA, ``D | T`` for MLA); an EAGLE draft (drafts stay whole)."""
    _refuse(model)
    cfg = model.cfg
    latent = isinstance(model.layers[0].attention, MLAttention)
    check_layout(n_heads=cfg.n_heads, n_kv_heads=None if latent else cfg.n_kv_heads,
                 intermediate_size=cfg.intermediate_size, tp=group.tp_size, dcp=group.size)
    if group.tp_size == 1:
        return model
    return shard_in_place(model, group.tp_size, group.tp_rank, group.tp_group_name)
