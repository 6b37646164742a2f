"""Process group, cache bookkeeping and ``prepare``."""

from dcp_compile.runtime.caches import CacheRecord, record_for
from dcp_compile.runtime.group import DCPGroup, init_group
from dcp_compile.runtime.prepare import Prepared, prepare

__all__ = ["CacheRecord", "DCPGroup", "Prepared", "init_group", "prepare", "record_for"]
