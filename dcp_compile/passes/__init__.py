"""The FX passes: find -> shard_kv_writes -> shard_attention -> check (invariants: README.md beside this file)."""

from dcp_compile.passes.check import check_draft, check_target
from dcp_compile.passes.find import AttentionSite, KVCache, KVWrite, Plan, find
from dcp_compile.passes.fx_utils import GraphPatternError
from dcp_compile.passes.pipeline import draft_passes, run_passes, target_passes
from dcp_compile.passes.shard_attention import shard_attention
from dcp_compile.passes.shard_kv_writes import shard_kv_writes

__all__ = [
    "AttentionSite",
    "GraphPatternError",
    "KVCache",
    "KVWrite",
    "Plan",
    "check_draft",
    "check_target",
    "draft_passes",
    "find",
    "run_passes",
    "shard_attention",
    "shard_kv_writes",
    "target_passes",
]
