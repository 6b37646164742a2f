"""Memory planning: what batch x context fits on one GPU at each DCP size.

A configuration that does not fit is refused before anything is allocated, with the
numbers, rather than failing later with an out-of-memory error at the first long prompt.

Per rank the plan counts

- the target weights: all of them, or under tensor parallelism of T ranks (``tp_size``)
  1/T of the attention and MLP projections beside the whole embedding, norms, LM head
  and MLA latent projection;
- the target KV cache: ``layers * 2 * H_kv * D * bytes * B * slots``, where ``slots`` is
  ``S_loc + 1 + verify_tokens`` when sharded (``S_loc`` local positions, the trash slot,
  the verify staging slots: ``k + 1`` for a chain of ``k``, ``draft_tokens + 1`` for a
  tree) and ``S`` for a chain on a group of one, which verifies in place; a tree target
  on a group of one is laid out as a shard too (``S + 1 + draft_tokens + 1``), since its
  siblings share positions;
- the draft: its weights (the embedding is shared with the target) and its whole KV cache
  (``S`` slots, plus a tree's ``(k - 1) * topk`` tree slots for its drafted nodes);
- a reserve for one step's activations: 2 GiB plus three fp32 copies of the step's logits
  (``B * step_tokens * vocab``).  A prefill of ``P`` tokens needs ``step_tokens=P``.

    planner = dcp.MemoryPlanner(cfg, dcp.device_budget("cuda"), draft=draft_cfg, verify_tokens=k + 1)
    # an EAGLE-2 tree of draft_tokens nodes:
    # dcp.MemoryPlanner(..., verify_tokens=draft_tokens + 1, tree=True, draft_tree_slots=(k - 1) * topk)
    planner.check(dcp_size=2, max_batch=8, max_seq_len=131072)   # CapacityError saying what fits
    planner.longest_context(dcp_size=2, max_batch=8)             # tokens per sequence that fit
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from dcp_compile.group import check_sizes
from dcp_compile.layout import KVLayout

GiB = 1 << 30
BASE_RESERVE_BYTES = 2 * GiB
LOGIT_COPIES = 3


class CapacityError(ValueError):
    """The requested batch x context does not fit the device at this DCP size."""


def step_reserve_bytes(max_batch: int, step_tokens: int, vocab_size: int) -> int:
    """Memory kept beside the weights and caches for a step's activations: a base, plus
    the fp32 logits of ``max_batch x step_tokens`` tokens a few times over."""
    return BASE_RESERVE_BYTES + LOGIT_COPIES * 4 * max_batch * step_tokens * vocab_size


def kv_slots(max_seq_len: int, dcp_size: int, interleave: int = 1, verify_tokens: int = 0, tree: bool = False) -> int:
    """Slots per sequence and layer that one rank's target cache holds; ``tree``: its
    verify graphs verify draft trees (laid out as a shard on a group of one too)."""
    if dcp_size == 1 and not tree:
        return max_seq_len
    return KVLayout.capacity_of(max_seq_len, dcp_size, interleave) + 1 + verify_tokens


def cache_bytes_per_token(cfg, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Target KV-cache bytes per token over all layers on one rank: keys and values per KV
    head for a ``LlamaConfig`` (``H_kv / T`` heads under TP, at least one); for an
    ``MLAConfig`` one shared latent and rope key per token, no heads (``(kv_lora_rank +
    qk_rope_head_dim)`` numbers per layer, whole on every TP rank)."""
    if hasattr(cfg, "kv_lora_rank"):
        return cfg.n_layers * cfg.cache_width * dtype.itemsize
    from dcp_compile.models.parallel import kv_heads_of

    return cfg.n_layers * 2 * len(kv_heads_of(0, tp_size, cfg.n_kv_heads)) * cfg.head_dim * dtype.itemsize


def _param_bytes(module_factory, dtype: torch.dtype, skip: tuple[str, ...] = (), tp_size: int = 1) -> int:
    """Bytes of the module's parameters on one rank; ``tp_size > 1``: of its shard, as
    ``dcp.tensor_parallel`` lays it out (on meta: nothing is allocated)."""
    with torch.device("meta"):
        module = module_factory()
    if tp_size > 1:
        from dcp_compile.models.parallel import shard_in_place

        shard_in_place(module, tp_size, tp_rank=0)
    return sum(p.numel() for name, p in module.named_parameters() if not name.startswith(skip)) * dtype.itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's bytes for a target (and draft) at a DCP size, against a budget."""

    dcp_size: int
    max_batch: int
    max_seq_len: int
    weight_bytes: int
    target_kv_bytes: int
    draft_bytes: int
    reserve_bytes: int
    budget_bytes: int
    tp_size: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.target_kv_bytes + self.draft_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def describe(self) -> str:
        tp = f"TP size {self.tp_size}, " if self.tp_size > 1 else ""
        return (
            f"{tp}DCP size {self.dcp_size}, {self.max_batch} x {self.max_seq_len} tokens: target KV "
            f"{self.target_kv_bytes / GiB:.1f} GiB + weights {self.weight_bytes / GiB:.1f} GiB + draft "
            f"{self.draft_bytes / GiB:.2f} GiB + reserve {self.reserve_bytes / GiB:.1f} GiB = "
            f"{self.total_bytes / GiB:.1f} GiB per rank, budget {self.budget_bytes / GiB:.1f} GiB"
        )


@dataclass(frozen=True)
class MemoryPlanner:
    """Plans for one target (and draft) config on one device budget."""

    target: object
    """A ``LlamaConfig``, or an ``MLAConfig`` (DeepSeek-style latent cache)."""
    budget_bytes: int
    dtype: torch.dtype = torch.bfloat16
    draft: object | None = None
    """A ``DraftConfig``, or None."""
    verify_tokens: int = 0
    """New tokens of a verify step, and its staging slots: ``k + 1`` for a chain of ``k``,
    ``draft_tokens + 1`` for a tree; 0 without a draft."""
    interleave: int = 1
    step_tokens: int | None = None
    tree: bool = False
    """The target verifies draft trees: its cache carries the trash and staging slots on a
    group of one too."""
    draft_tree_slots: int = 0
    """The draft's tree slots past its cache (``TreeShape.tree_slots``): 0 for a chain."""
    tp_size: int = 1
    """T: the target is tensor-parallel over T ranks (``dcp.tensor_parallel``); the DCP
    size of each plan then divides T."""

    @cached_property
    def _weight_bytes(self) -> tuple[int, int]:
        from dcp_compile.models import EagleDraft, Llama
        from dcp_compile.models.mla import MLAConfig, MLATransformer

        model = MLATransformer if isinstance(self.target, MLAConfig) else Llama
        target = _param_bytes(lambda: model(self.target), self.dtype, tp_size=self.tp_size)
        draft = 0 if self.draft is None else _param_bytes(lambda: EagleDraft(self.draft), self.dtype, skip=("embed.",))
        return target, draft

    def plan(self, dcp_size: int, max_batch: int, max_seq_len: int) -> MemoryPlan:
        cfg = self.target
        for name, value in (("dcp_size", dcp_size), ("max_batch", max_batch), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_sizes(self.tp_size, dcp_size)
        per_slot = cache_bytes_per_token(cfg, self.dtype, self.tp_size)
        slots = kv_slots(max_seq_len, dcp_size, self.interleave, self.verify_tokens, self.tree)
        target_weights, draft_bytes = self._weight_bytes
        if self.draft is not None:
            # The draft's one layer caches per-head keys and values whole (its shapes are
            # those of the config it was built for: an MLA target's draft is a Llama layer).
            shapes = self.draft.target
            draft_slots = max_seq_len + self.draft_tree_slots
            draft_bytes += 2 * shapes.n_kv_heads * shapes.head_dim * self.dtype.itemsize * max_batch * draft_slots
        step = self.step_tokens or max(self.verify_tokens, 1)
        return MemoryPlan(
            dcp_size=dcp_size, max_batch=max_batch, max_seq_len=max_seq_len,
            weight_bytes=target_weights, tp_size=self.tp_size,
            target_kv_bytes=per_slot * max_batch * slots,
            draft_bytes=draft_bytes,
            reserve_bytes=step_reserve_bytes(max_batch, step, cfg.vocab_size),
            budget_bytes=self.budget_bytes,
        )

    def smallest_dcp_size(self, max_batch: int, max_seq_len: int, largest: int = 64) -> int | None:
        sizes = [n for n in range(1, largest + 1) if self.tp_size == 1 or self.tp_size % n == 0]
        return next((n for n in sizes if self.plan(n, max_batch, max_seq_len).fits), None)

    def largest_batch(self, dcp_size: int, max_seq_len: int) -> int:
        return _largest(lambda b: self.plan(dcp_size, b, max_seq_len).fits)

    def longest_context(self, dcp_size: int, max_batch: int) -> int:
        return _largest(lambda s: self.plan(dcp_size, max_batch, s).fits)

    def check(self, dcp_size: int, max_batch: int, max_seq_len: int) -> MemoryPlan:
        """The plan, or a ``CapacityError`` saying what does fit."""
        plan = self.plan(dcp_size, max_batch, max_seq_len)
        if plan.fits:
            return plan
        options = []
        n = self.smallest_dcp_size(max_batch, max_seq_len)
        if n is not None:
            options.append(f"a DCP group of {n} ranks")
        batch = self.largest_batch(dcp_size, max_seq_len)
        if batch:
            options.append(f"max_batch={batch} at this context")
        context = self.longest_context(dcp_size, max_batch)
        if context:
            options.append(f"max_seq_len={context} at this batch")
        fix = "; ".join(options) if options else "nothing at this DCP size: even the weights do not fit"
        raise CapacityError(f"does not fit: {plan.describe()}. What fits: {fix}")


@dataclass(frozen=True)
class PoolPlan:
    """One rank's bytes for a paged KV pool at a DCP size: the pool holds ``kv_tokens``
    positions for the whole group, ``kv_tokens / dcp_size`` on each rank, in pages of
    ``page_size`` slots a rank (a logical page spans ``page_size * dcp_size`` tokens)."""

    dcp_size: int
    max_batch: int
    page_size: int
    kv_tokens: int
    """N: the group's capacity in tokens, every running request's together."""
    weight_bytes: int
    target_pool_bytes: int
    """The target's pages on this rank: N / D positions."""
    draft_pool_bytes: int
    """The draft's pages: N positions, whole on every rank, since the draft is never sharded."""
    row_bytes: int
    """Per running row, outside the pool: the target's trash and verify staging slots, the
    draft's tree slots."""
    reserve_bytes: int
    budget_bytes: int
    """The part of the device the pool may fill (``fraction`` of it)."""
    tp_size: int = 1

    @property
    def rank_tokens(self) -> int:
        return self.kv_tokens // self.dcp_size

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.target_pool_bytes + self.draft_pool_bytes + self.row_bytes + self.reserve_bytes

    def describe(self) -> str:
        tp = f"TP size {self.tp_size}, " if self.tp_size > 1 else ""
        return (
            f"{tp}DCP size {self.dcp_size}, {self.max_batch} rows, pages of {self.page_size}: a pool of "
            f"{self.kv_tokens:,} tokens ({self.rank_tokens:,} a rank): target pages "
            f"{self.target_pool_bytes / GiB:.1f} GiB + draft pages {self.draft_pool_bytes / GiB:.1f} GiB + rows "
            f"{self.row_bytes / GiB:.2f} GiB + weights {self.weight_bytes / GiB:.1f} GiB + reserve "
            f"{self.reserve_bytes / GiB:.1f} GiB = {self.total_bytes / GiB:.1f} GiB per rank, of "
            f"{self.budget_bytes / GiB:.1f} GiB"
        )


def pool_plan(planner: MemoryPlanner, dcp_size: int, max_batch: int, page_size: int, fraction: float = 0.9) -> PoolPlan:
    """The largest paged pool that fits ``fraction`` of the device beside the weights, the
    reserve of ``max_batch`` running rows and their per-row slots.  Each rank holds N/D of
    the target's tokens and all N of the draft's: a whole draft page costs every rank its
    full size, which is what bounds N once D is large."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if page_size % planner.interleave:
        raise ValueError(
            f"page_size {page_size} is not a multiple of the layout's interleave {planner.interleave}: a page must hold "
            f"whole blocks of a rank's positions; use a multiple of {planner.interleave}"
        )
    if not 0 < fraction <= 1:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    base = planner.plan(dcp_size, max_batch, 1)
    per_slot = cache_bytes_per_token(planner.target, planner.dtype, planner.tp_size)
    draft_per_token = 0
    if planner.draft is not None:
        shapes = planner.draft.target
        draft_per_token = 2 * shapes.n_kv_heads * shapes.head_dim * planner.dtype.itemsize
    slack = 1 + planner.verify_tokens if dcp_size > 1 or planner.tree else 0
    row_bytes = max_batch * (per_slot * slack + draft_per_token * planner.draft_tree_slots)
    draft_weights = planner._weight_bytes[1]
    budget = int(planner.budget_bytes * fraction)
    free = budget - base.weight_bytes - draft_weights - base.reserve_bytes - row_bytes
    # t positions a rank: the target's t slots here, the draft's t * D (the group's tokens) whole.
    per_rank = max(0, free) // (per_slot + dcp_size * draft_per_token) // page_size * page_size
    return PoolPlan(
        dcp_size=dcp_size, max_batch=max_batch, page_size=page_size, kv_tokens=per_rank * dcp_size,
        weight_bytes=base.weight_bytes + draft_weights, target_pool_bytes=per_slot * per_rank,
        draft_pool_bytes=draft_per_token * per_rank * dcp_size, row_bytes=row_bytes, reserve_bytes=base.reserve_bytes,
        budget_bytes=budget, tp_size=planner.tp_size,
    )


def _largest(fits) -> int:
    """The largest positive int ``x`` with ``fits(x)`` (monotone), or 0."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def device_budget(device: str | torch.device) -> int:
    """Total memory of a CUDA device, in bytes."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"no memory budget is known for device {device}; pass budget_bytes=")
    return torch.cuda.get_device_properties(device).total_memory


def plan_memory(
    target,
    *,
    dcp_size: int,
    max_batch: int,
    max_seq_len: int,
    device: str | torch.device | None = None,
    budget_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    draft=None,
    verify_tokens: int = 0,
    interleave: int = 1,
    step_tokens: int | None = None,
    tree: bool = False,
    draft_tree_slots: int = 0,
    tp_size: int = 1,
) -> MemoryPlan:
    """One rank's memory for ``target`` (a ``LlamaConfig``) at ``dcp_size``; the budget is
    ``budget_bytes`` or the total memory of the CUDA ``device``.  ``.fits`` says whether it
    fits; ``MemoryPlanner(...).check`` raises with what would."""
    if budget_bytes is None:
        if device is None:
            raise ValueError("plan_memory needs device= (a CUDA device) or budget_bytes=")
        budget_bytes = device_budget(device)
    planner = MemoryPlanner(target, budget_bytes, dtype, draft, verify_tokens, interleave, step_tokens, tree,
                            draft_tree_slots, tp_size)
    return planner.plan(dcp_size, max_batch, max_seq_len)


def capacity_tables(planner: MemoryPlanner, dcp_sizes, batches, contexts) -> tuple[dict, dict]:
    """What fits, per DCP size: ``{batch: {size: longest context}}`` and
    ``{context: {size: most sequences}}`` (where the KV pool runs out); 0 where
    nothing fits."""
    longest = {b: {n: planner.longest_context(n, b) for n in dcp_sizes} for b in batches}
    widest = {c: {n: planner.largest_batch(n, c) for n in dcp_sizes} for c in contexts}
    return longest, widest
