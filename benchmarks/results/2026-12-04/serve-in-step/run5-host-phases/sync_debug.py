"""Which host calls synchronize the device in the engine's steady state with finishes and
late arrivals (as a server sees them): torch.cuda.set_sync_debug_mode("warn") after warm-up,
each warning printed with the Python stack that raised it."""
import collections, sys, time, traceback, warnings
import torch
import dcp_compile as dcp
from dcp_compile.commands import loading
from dcp_compile.runtime.engine import SamplingParams, SpecEngine

device = torch.device("cuda")
spec = loading.resolve("tiny-code", None)
target, draft = loading.load(spec, max_batch=16, max_seq_len=1024, device=device, dtype=torch.bfloat16)
decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=4, max_batch=16, max_seq_len=1024,
                          cuda_graphs=True, lowering="inductor")
engine = SpecEngine(decoder)
def run(n_req, lag):
    pending = collections.deque((i, [1 + i % 50, 2, 3], 8 + (i * 7) % 90) for i in range(n_req))
    finished_at = []
    step = 0
    while pending or engine.has_work():
        while pending and engine.free_rows > 0 and (not finished_at or step - finished_at[0] >= lag):
            i, p, n = pending.popleft()
            engine.add_request(p, SamplingParams(max_new_tokens=n))
            if finished_at: finished_at.pop(0)
        for rid, ev in engine.step().items():
            if ev.finished_by: finished_at.append(step)
        step += 1
    return step
run(40, 0)
seen = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    stack = "".join(traceback.format_stack(limit=12)[:-2])
    key = stack.strip().splitlines()[-2:]
    seen[tuple(key)] += 1
    if seen[tuple(key)] == 1:
        print("SYNC:", message, "\n", stack, flush=True)
warnings.showwarning = show
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
t = time.perf_counter(); steps = run(60, 3); print("steps", steps, "s", time.perf_counter() - t)
torch.cuda.set_sync_debug_mode(0)
for k, v in seen.most_common(): print(v, "x", k)
print("waits", engine.stats["device_waits"], "long", engine.stats["device_long_waits"], engine.stats["device_long_wait_seconds"])
