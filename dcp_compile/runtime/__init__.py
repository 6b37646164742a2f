"""Process group, cache bookkeeping and ``prepare``."""

from dcp_compile.records import CacheRecord, record_for
from dcp_compile.group import DCPGroup, init_group
from dcp_compile.runtime.prepare import Prepared, prepare

__all__ = ["CacheRecord", "DCPGroup", "Prepared", "init_group", "prepare", "record_for"]
