"""dcp-compile: decode context parallelism as a torch.compile backend.

    group = dcp.init_group()
    dcp.prepare(target, group, role="target", max_batch=B, max_seq_len=S)
    target_c = torch.compile(target, backend=dcp.backend(group, role="target"), fullgraph=True)
"""

from dcp_compile import ops
from dcp_compile.backend import Backend, backend
from dcp_compile.layout import KVLayout
from dcp_compile.memory import CapacityError, MemoryPlan, MemoryPlanner, device_budget, plan_memory
from dcp_compile.models.parallel import tensor_parallel
from dcp_compile.runtime import DCPGroup, Prepared, init_group, prepare
from dcp_compile.runtime.commit import KVCommit
from dcp_compile.runtime.engine import RequestOutput, generate_all
from dcp_compile.runtime.spec import SpecDecoder

__all__ = [
    "Backend", "CapacityError", "DCPGroup", "KVCommit", "KVLayout", "MemoryPlan", "MemoryPlanner", "Prepared",
    "RequestOutput", "SpecDecoder", "backend", "device_budget", "generate_all", "init_group", "ops", "plan_memory",
    "prepare", "tensor_parallel",
]
__version__ = "0.1.0"
