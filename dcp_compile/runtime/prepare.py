"""prepare: discover a model's KV caches and give each rank the buffers it will own.

Dynamo traces with real shapes, so the local cache buffers must exist before
``torch.compile`` sees the model.  ``prepare`` runs a discovery trace (``discovery``:
Dynamo on fake tensors, nothing is executed), reuses the ``find`` pass to locate the
caches, then:

- target role, group of N > 1: checks that every attention over a cache has a mask
  proven position-causal (``passes.causal_mask``), swaps every cache for a zeroed local
  buffer of ``S_loc + 1`` slots along its sequence axis, and shards the last axis of any
  causal-mask table the masks index (after checking it is lower triangular), so that
  the model traces;
- draft role, or a group of size 1: leaves every buffer as it is.

All ranks first exchange a fingerprint of the model config and the prepare arguments,
so ranks that built different models fail here, with the numbers, instead of
deadlocking or corrupting a collective later.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import types
from dataclasses import dataclass

import torch
from torch import nn

from dcp_compile.group import DCPGroup, gather_from_ranks
from dcp_compile.layout import KVLayout
from dcp_compile.memory import CapacityError, GiB
from dcp_compile.ops.guard import guard
from dcp_compile.passes.find import Plan, find
from dcp_compile.passes.fx_utils import GraphPatternError
from dcp_compile.records import ROLES, CacheRecord, record_for, register, register_paged, register_table
from dcp_compile.runtime.discovery import default_example_inputs, discover, replace_tensor
from dcp_compile.runtime.paging import (Paging, PoolBudget, paged_buffers, paged_bytes, paged_shapes, plan_paging,
                                        pool_tokens_from_memory)
from dcp_compile.runtime.peers import check_peers_hold_the_same_kv


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` did to a model."""

    role: str
    caches: tuple[CacheRecord, ...]
    mask_buffers: tuple[str, ...]
    """Buffers whose last axis was sharded to the local cache length."""
    kv_bytes: int
    """Bytes of KV cache this rank holds for the model."""
    paging: Paging | None = None
    """The pool's shape and the block table the caches share (``prepare(page_size=...)``)."""


def _fingerprint(model: nn.Module, role: str, *prepare_args: int) -> int:
    digest = hashlib.sha256(f"{type(model).__qualname__}|{role}|{prepare_args}".encode())
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in named:
            digest.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return int.from_bytes(digest.digest()[:7], "little")


def _check_ranks_agree(group: DCPGroup, fingerprint: int, role: str) -> None:
    if group.replica_size == 1:
        return
    mine = torch.tensor([fingerprint], dtype=torch.long, device=group.device)
    prints = [int(t.item()) for t in gather_from_ranks(group, mine)]
    if len(set(prints)) > 1:
        differ = [r for r, f in enumerate(prints) if f != prints[0]]
        raise ValueError(
            f"ranks disagree on the {role} model config at prepare: config fingerprints per rank {prints} "
            f"(ranks {differ} differ from rank 0). Every rank must build the same model (same parameter and "
            f"buffer names, shapes, dtypes) and call prepare with the same max_batch, max_seq_len and interleave"
        )


def _home_device(model: nn.Module) -> torch.device:
    """Where this model computes: the device of its parameters (of its buffers if it has none)."""
    devices = {p.device for p in model.parameters() if not p.is_meta}
    if not devices and not any(True for _ in model.parameters()):
        devices = {b.device for b in model.buffers() if not b.is_meta}
    if not devices:
        raise ValueError(
            f"{type(model).__name__} has no parameters off the meta device; load its weights before prepare "
            f"(only KV caches may stay on meta, for prepare to allocate)"
        )
    if len(devices) > 1:
        raise ValueError(f"{type(model).__name__} has parameters on several devices {sorted(map(str, devices))}; "
                         f"put the whole model on one device before prepare")
    return devices.pop()


def _check_free_memory(device: torch.device, pending: list, rank: int) -> None:
    """Refuse, before allocating, KV caches that the device has no room for."""
    need = sum(math.prod(shape) * dtype.itemsize for _, _, shape, dtype in pending)
    if device.type != "cuda" or not need:
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > free:
        raise CapacityError(
            f"prepare would allocate {need / GiB:.1f} GiB of KV cache on rank {rank} ({device}), which has "
            f"{free / GiB:.1f} GiB free of {total / GiB:.1f} GiB. Choose a batch x context that fits with "
            f"dcp.MemoryPlanner, or shard it over more ranks"
        )


def is_lower_triangular(table: torch.Tensor, rows_per_block: int = 1024) -> bool:
    """``table[p, s] == (s <= p)`` (bool) or ``0`` / ``-inf``-like (additive) for every entry."""
    if table.dim() != 2:
        return False
    n_rows, n_cols = table.shape
    slots = torch.arange(n_cols, device=table.device)
    for start in range(0, n_rows, rows_per_block):
        rows = torch.arange(start, min(start + rows_per_block, n_rows), device=table.device)
        allowed = slots[None, :] <= rows[:, None]
        block = table[start : start + len(rows)]
        if table.dtype == torch.bool:
            ok = torch.equal(block, allowed)
        else:
            ok = bool(((block == 0) == allowed).all()) and bool((block[~allowed] <= -1e4).all())
        if not ok:
            return False
    return True


def _local_mask(mask: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The columns of ``mask`` for this rank's slots; the trash column and slots past the
    end are fully masked."""
    slots = torch.arange(layout.local_cache_len, device=mask.device)
    positions = layout.global_position(slots)
    real = (slots < layout.local_capacity) & (positions < layout.max_seq_len)
    columns = mask.index_select(-1, torch.where(real, positions, 0))
    blocked = torch.zeros((), dtype=mask.dtype) if mask.dtype == torch.bool else torch.tensor(float("-inf"), dtype=mask.dtype)
    return torch.where(real, columns, blocked.to(mask.device))


def _first_batched(args, kwargs) -> torch.Tensor | None:
    return next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)


def _call_checks(model_name: str, max_batch: int, sharded: bool):
    """The forward pre-hook of a prepared model: the batch must be the one prepare laid
    the caches out for, and a sharded model's inputs are marked so that only graphs
    ``dcp.backend`` compiled can run it (``ops.guard``)."""

    def hook(module, args, kwargs):
        batched = _first_batched(args, kwargs)
        if batched is not None and batched.shape[0] != max_batch:
            raise ValueError(
                f"batch of {batched.shape[0]} rows, but the model was prepared for max_batch={max_batch}: its KV "
                f"caches hold {max_batch} rows. Split the batch, or pad it to {max_batch} rows, or prepare a model "
                f"built for the batch you need"
            )
        if not sharded:
            return None
        if not torch.compiler.is_compiling():
            guard(torch.empty(()), model_name)  # raises: an eager call of a sharded model
        mark = lambda t: guard(t, model_name) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tuple(mark(a) for a in args), {k: mark(v) for k, v in kwargs.items()}

    return _own_code(hook)


_hooks_made = itertools.count()


def _own_code(fn):
    """``fn`` with a code object of its own.  Dynamo compiles a forward pre-hook as a
    frame of its own and counts recompiles per code object: with one shared code
    object, every prepared model's every call shape (a target's prefill and verify, a
    draft's three graphs, both arms of a comparison) would add to one count and reach
    the recompile limit."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_hooks_made)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _refuse_replaced_caches(model: nn.Module, placed) -> None:
    """``model.to(...)``, ``.half()``, ``.cuda()`` after prepare make new cache tensors,
    which the backend would not know: say so at that call."""
    original = model._apply

    def _apply(fn, recurse=True):
        result = original(fn, recurse)
        replaced = [record.name for module, attr, record in placed if record_for(getattr(module, attr)) is not record]
        if replaced:
            raise RuntimeError(
                f"{type(model).__name__}.to() / .half() / .cuda() (or another _apply) after dcp.prepare replaced its "
                f"KV caches {replaced[:3]}{' ...' if len(replaced) > 3 else ''}, which prepare laid out for this rank; "
                f"the model can no longer be compiled. The order is: build the model, move or cast it with .to(), "
                f"then call dcp.prepare"
            )
        return result

    model._apply = _apply


def _check_forward_with_shards(model: nn.Module, forward_args: tuple, placed: list, max_seq_len: int) -> None:
    """One forward on fake tensors with this rank's shards in place (nothing real is
    read or written).  A model that sizes a tensor by ``max_seq_len`` where it meets the
    cache (``torch.arange(MAX_SEQ_LEN)`` for a mask, say) no longer fits a shard of fewer
    slots; say so here, rather than leave a shape error naming an unexplained slot count
    to the first compile.  Any other failure is left to ``torch.compile`` to report."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shard_lengths = {int(getattr(module, attr).shape[record.seq_dim]) for module, attr, record in placed}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model.forward(*forward_args)
    except Exception as error:  # noqa: BLE001 - only a shard-size mismatch is ours to explain
        text = str(error)
        numbers = {int(n) for n in re.findall(r"\d+", text)}
        seen = sorted(shard_lengths & numbers)
        if max_seq_len in numbers and seen:
            raise ValueError(
                f"{type(model).__name__}.forward does not run with this rank's cache shards: it failed with "
                f"'{text.splitlines()[0][:300]}'. Each sharded cache now holds {seen[0]} slots, not max_seq_len="
                f"{max_seq_len}, and a tensor of max_seq_len entries meets it; size such tensors from the cache "
                f"itself (torch.arange(self.kv_cache.shape[seq_dim]) <= positions, not torch.arange(max_seq_len)), "
                f"as dcp_compile/models/llama.py and mla.py do"
            ) from error


def _place_caches(model, plan, inputs, owners, layout: KVLayout, role: str, max_batch: int, verify_tokens: int, home,
                  rank: int, tree_slots: int = 0, paging: Paging | None = None) -> tuple[list, int]:
    """Swap each cache for this rank's buffer (its shard plus ``verify_tokens`` staging
    slots, a whole buffer plus ``tree_slots``, or a whole buffer where a meta one stood)
    and record it; returns ``(module, attr, record)`` per cache and the bytes this rank
    now holds."""
    max_seq_len = layout.max_seq_len
    sharded = layout.size > 1 or verify_tokens > 0 or paging is not None  # a tree or paged target of one rank too
    placed, pending, kv_bytes = [], [], 0
    for cache in plan.caches:
        tensor = inputs[cache.input_index]
        if id(tensor) not in owners:
            raise ValueError(
                f"KV cache {cache.name} is not a buffer (or tensor attribute) of {type(model).__name__} or its "
                f"submodules; create it with module.register_buffer(...) so that prepare can replace it with this "
                f"rank's shard (Hugging Face caches: see dcp_compile.hf)"
            )
        qualname, module, attr = owners[id(tensor)]
        if record_for(tensor) is not None:
            raise ValueError(f"KV cache {qualname} was already prepared; call dcp.prepare once per model")
        if tensor.shape[cache.seq_dim] != max_seq_len or tensor.shape[0] != max_batch:
            raise ValueError(
                f"KV cache {qualname} has shape {tuple(tensor.shape)} (batch axis 0, sequence axis "
                f"{cache.seq_dim}); expected batch {max_batch} and sequence {max_seq_len} from prepare's "
                f"max_batch and max_seq_len"
            )
        if sharded or tree_slots or tensor.is_meta:
            local_shape = list(tensor.shape)
            if sharded:
                local_shape[cache.seq_dim] = layout.local_cache_len + verify_tokens
            local_shape[cache.seq_dim] += tree_slots
            pending.append((module, attr, local_shape, tensor.dtype))
        placed.append((module, attr, CacheRecord(
            qualname, role, cache.seq_dim, layout, tuple(tensor.shape), verify_tokens, tree_slots,
            paging.page_size if paging else 0,
        )))
    if paging is not None:
        return _place_paged(placed, pending, paging, home, layout, rank)
    _check_free_memory(home, pending, rank)
    for module, attr, shape, dtype in pending:
        replace_tensor(module, attr, torch.zeros(shape, dtype=dtype, device=home))
    for module, attr, record in placed:
        tensor = getattr(module, attr)
        register(tensor, record)
        kv_bytes += tensor.numel() * tensor.element_size()
    return placed, kv_bytes


def _paging(plan, inputs, layout: KVLayout, max_batch: int, verify_tokens: int, page_size: int,
            kv_tokens: int | None, group, home, budget: PoolBudget | None) -> Paging | None:
    """The pool and its block table, or ``None`` without a page size.  A pool sized from
    ``home``'s free memory counts one slot of every cache, and every row's slots outside
    the pool (its trash and staging slots)."""
    if not page_size:
        return None
    if not kv_tokens:
        slot_bytes = 0
        for cache in plan.caches:
            tensor = inputs[cache.input_index]
            slot_bytes += tensor.numel() // (tensor.shape[0] * tensor.shape[cache.seq_dim]) * tensor.element_size()
        row_slots = layout.local_cache_len + verify_tokens - layout.local_capacity
        kv_tokens = pool_tokens_from_memory(slot_bytes, max_batch * row_slots * slot_bytes, page_size, layout, group,
                                            home, budget or PoolBudget())
    return plan_paging(page_size, kv_tokens, layout, max_batch, home)


def _place_paged(placed: list, pending: list, paging: Paging, home, layout: KVLayout, rank: int) -> tuple[list, int]:
    """Each cache as a stand-in of its local shape, its slots in pages (``runtime.paging``)."""
    capacity, allocations = layout.local_capacity, []
    for (_, _, shape, dtype), (_, _, record) in zip(pending, placed):  # refused before anything is allocated
        for allocated in paged_shapes(shape, record.seq_dim, paging, capacity, record.name):
            allocations.append((None, None, allocated, dtype))
    _check_free_memory(home, allocations, rank)
    made = [paged_buffers(shape, record.seq_dim, dtype, home, paging, capacity, record.name)
            for (_, _, shape, dtype), (_, _, record) in zip(pending, placed)]
    for (module, attr, record), (stand_in, paged) in zip(placed, made):
        replace_tensor(module, attr, stand_in)
        register(stand_in, record)
        register_paged(stand_in, paged)
    return placed, sum(paged_bytes(paged) for _, paged in made)


def _shard_mask_tables(plan, inputs, owners, layout: KVLayout, home) -> list[str]:
    """Check every causal-mask table the proven masks index and keep this rank's columns."""
    max_seq_len = layout.max_seq_len
    mask_names = []
    for index in plan.mask_inputs:
        tensor = inputs[index]
        if id(tensor) not in owners:
            raise ValueError(
                f"graph input {index} is a causal-mask table indexed by positions but not a buffer (or tensor "
                f"attribute) of the model; make it a buffer or build the mask from positions inside forward"
            )
        qualname, module, attr = owners[id(tensor)]
        tensor = getattr(module, attr)
        if tensor.is_meta:
            raise ValueError(
                f"causal-mask table {qualname} is on the meta device; only KV caches may be left on meta for "
                f"prepare to allocate. Build the table on the model's device ({home})"
            )
        if tensor.shape[-1] != max_seq_len or not is_lower_triangular(tensor):
            raise GraphPatternError(
                f"causal-mask table {qualname} (shape {tuple(tensor.shape)}) is indexed by positions to mask "
                f"attention over the KV cache, but it is not lower triangular over max_seq_len={max_seq_len} "
                f"slots (table[p, s] == (s <= p)); DCP shards full causal attention only"
            )
        local = _local_mask(tensor, layout)
        replace_tensor(module, attr, local)
        register_table(local, qualname)
        mask_names.append(qualname)
    return mask_names


def _check_arguments(group: DCPGroup, role: str, max_batch, max_seq_len, interleave, verify_tokens, tree,
                     tree_slots=0, page_size=0) -> bool:
    """Refuse ``prepare``'s arguments before any rank exchanges anything or the model is
    touched; returns whether the role's caches are laid out as shards (over the group, or
    as one rank's shard for a tree target)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("interleave", interleave)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(verify_tokens, int) or verify_tokens < 0:
        raise ValueError(f"verify_tokens must be a non-negative int, got {verify_tokens!r}")
    if tree and (role != "target" or verify_tokens < 2):
        raise ValueError(
            f"tree=True lays out a target's caches for tree verify graphs and needs verify_tokens >= 2 (the root "
            f"and at least one node); got role={role!r}, verify_tokens={verify_tokens}. A draft's cache stays whole"
        )
    if not isinstance(tree_slots, int) or tree_slots < 0 or (tree_slots and role != "draft"):
        raise ValueError(
            f"tree_slots gives a draft's cache room for a tree's drafted nodes ((k - 1) * topk): a non-negative int "
            f"for role='draft', got tree_slots={tree_slots!r} for role={role!r}")
    if page_size and role != "target":
        raise ValueError(f"page_size pages a target's caches; the {role}'s cache stays whole, in rows")
    sharded = role == "target" and (group.size > 1 or tree or bool(page_size))
    if sharded and group.size * interleave > max_seq_len:
        raise ValueError(
            f"DCP size {group.size} (x interleave {interleave}) is larger than max_seq_len={max_seq_len}: some "
            f"ranks would own no position. Use a group of at most {max_seq_len // interleave} ranks or a larger max_seq_len"
        )
    return sharded


def _find_caches(model: nn.Module, gm, sharded: bool) -> Plan:
    """The ``find`` plan of the discovery graph, refused when it holds no KV cache or, for
    sharded caches, an attention whose mask is not proven position-causal."""
    plan = find(gm)
    if sharded:
        for site in plan.sites:
            if not site.mask.proven:
                raise GraphPatternError(site.mask.failure)
    if not plan.caches:
        raise ValueError(
            f"{type(model).__name__} has no KV cache: expected buffers written along a sequence axis by "
            f"index_copy_, index_put_ or cache[..., positions, ...] = kv in forward, found none. "
            f"dcp-compile shards static KV caches; see dcp_compile/models/llama.py for the expected form"
        )
    return plan


def _refuse_sites(model: nn.Module, plan: Plan, tree: bool, page_size: int) -> None:
    """Attention sites the asked-for layout cannot serve, refused before any cache is replaced."""
    if page_size and any(site.expanded is not None for site in plan.sites):
        raise GraphPatternError(
            f"{type(model).__name__} computes its keys and values from the cache (a slot-wise map, such as "
            f"transformers' DeepSeek projecting its cached latent), so its prefix reads the cache itself, which "
            f"page_size leaves without memory; page_size pages caches that attention reads as they are stored. "
            f"Prepare this model without page_size")
    if tree and any(site.latent is not None for site in plan.sites):
        raise GraphPatternError(
            f"{type(model).__name__} attends through MLA's latent cache, whose window takes no tree mask yet: "
            f"draft a chain (topk=1, draft_tokens=k) for this target")


def prepare(
    model: nn.Module,
    group: DCPGroup,
    role: str = "target",
    *,
    max_batch: int,
    max_seq_len: int,
    example_inputs: tuple | None = None,
    interleave: int = 1,
    verify_tokens: int = 0,
    tree: bool = False,
    tree_slots: int = 0,
    page_size: int = 0,
    kv_tokens: int | None = None,
    pool_budget: PoolBudget | None = None,
) -> Prepared:
    """Discover ``model``'s KV caches and lay them out for ``role`` on this rank.

    Args:
        model: the module to be compiled; its KV caches must be registered buffers.
        group: from ``dcp.init_group()``.
        role: ``"target"`` (caches sharded over the group) or ``"draft"`` (whole).
        max_batch: batch rows of the cache buffers.
        max_seq_len: global sequence capacity ``S`` of the cache buffers.
        example_inputs: positional arguments of one forward call, for the discovery
            trace; built from the forward signature when omitted.
        interleave: ``I``, consecutive positions stored on one rank.
        verify_tokens: most new tokens per sequence a verify graph will bring (``k + 1``
            for a chain of ``k`` drafts); a sharded target's caches get that many staging
            slots after the trash slot. 0: no verify graphs.
        tree: the verify graphs verify draft trees, whose siblings share positions, so even
            a group of one stages their new tokens for a commit: the caches are laid out as one
            rank's shard (owner slots, the trash slot, ``verify_tokens`` staging slots).
        tree_slots: a draft's cache gets that many slots past ``max_seq_len``, where a draft
            tree's depths keep their nodes for the later ones (``TreeCall(draft, staged=True)``).
        page_size, kv_tokens, pool_budget: a target's caches in pages of ``page_size`` slots
            a rank, a pool of ``kv_tokens`` over the group (``runtime.paging``); without
            ``kv_tokens`` (CUDA only), what ``pool_budget`` (0.9 of the device) leaves.
    """
    sharded = _check_arguments(group, role, max_batch, max_seq_len, interleave, verify_tokens, tree, tree_slots,
                               page_size)
    _check_ranks_agree(group, _fingerprint(model, role, max_batch, max_seq_len, interleave, verify_tokens, tree,
                                           tree_slots, page_size, kv_tokens or 0), role)
    home = _home_device(model)
    forward_args = tuple(default_example_inputs(model, max_batch, home) if example_inputs is None else example_inputs)
    gm, inputs, owners, weights = discover(model, forward_args, example_inputs is None, max_batch)
    plan = _find_caches(model, gm, sharded)
    if role == "target" and group.size > 1 and group.heads_split:
        check_peers_hold_the_same_kv(group, gm, plan, inputs, weights)
    _refuse_sites(model, plan, tree, page_size)
    layout = KVLayout(group.size, group.rank, max_seq_len, interleave) if sharded else KVLayout(1, 0, max_seq_len, 1)
    paging = _paging(plan, inputs, layout, max_batch, verify_tokens, page_size, kv_tokens, group, home, pool_budget)
    placed, kv_bytes = _place_caches(model, plan, inputs, owners, layout, role, max_batch, verify_tokens * sharded,
                                     home, group.rank, tree_slots, paging)
    mask_names = _shard_mask_tables(plan, inputs, owners, layout, home) if sharded else []
    if sharded:
        _check_forward_with_shards(model, forward_args, placed, max_seq_len)
    model.register_forward_pre_hook(_call_checks(type(model).__name__, max_batch, sharded), with_kwargs=True)
    _refuse_replaced_caches(model, placed)
    return Prepared(role, tuple(record for _, _, record in placed), tuple(mask_names), kv_bytes, paging)
