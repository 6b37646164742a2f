"""Compile the seesaw kernel (``dcp_compile/ops/gluon_latent.py``) for sm_90a on a machine
without a GPU, and print what ptxas reports, as JSON:

    python tests/ops/compile_sm90.py fp32 fp16    # the forms of its slices' partials

A stand-in driver names the target (compute capability 9.0, warps of 32) so that Triton
lowers the kernel as it would on an H100 or H200; Triton's own ptxas assembles the PTX.
tests/ops/test_triton_latent.py runs this.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


class Hopper:
    """Just enough of a driver for ``JITFunction.warmup`` to compile for sm_90."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def compiled(partials: str) -> dict:
    """The kernel for 128 heads, 2 sequences of 1,024 slots in 4 slices: shared memory
    and ptxas's registers and spills."""
    import torch
    import triton

    from dcp_compile.ops import gluon_latent

    B, H, S, splits = 2, 128, 1024, 4
    q = torch.zeros(B, H, 1, 576, dtype=torch.bfloat16)
    latent, rope = torch.zeros(B, 1, S, 512, dtype=torch.bfloat16), torch.zeros(B, 1, S, 64, dtype=torch.bfloat16)
    o_part, scale_part, lse_part = gluon_latent._seesaw_outputs(q, splits, partials)
    kernel = gluon_latent._latent_seesaw_kernel.warmup(
        *gluon_latent._descriptors(q, latent, rope), torch.full((B,), S), o_part, scale_part, lse_part, 0.1, S, H,
        None, num_warps=4, grid=(2, splits, B))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    return dict(shared=kernel.metadata.shared, registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_stores=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
                spill_loads=int(re.search(r"(\d+) bytes spill loads", report).group(1)))


def main(forms: list[str]) -> None:
    from triton.runtime import driver

    driver.set_active(Hopper())
    print(json.dumps({form: compiled(form) for form in forms}))


if __name__ == "__main__":
    main(sys.argv[1:])
