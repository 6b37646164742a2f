"""Compile the seesaw kernel (``dcp_compile/ops/gluon_latent.py``) and the merge of its
slices for sm_90a on a machine without a GPU, and print what ptxas reports, as JSON:

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


def ptxas_report(ptx_text: str) -> dict:
    """Registers and spills of one kernel's PTX, assembled for sm_90a by Triton's ptxas."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(ptx_text)
        done = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_stores=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
                spill_loads=int(re.search(r"(\d+) bytes spill loads", report).group(1)))


def compiled(partials: str) -> dict:
    """The kernel for 128 heads, 2 sequences of 1,024 slots in 4 slices, and the merge of
    its partials: each one's shared memory and ptxas's registers and spills."""
    import torch
    import triton

    from dcp_compile.ops import gluon_latent, triton_prefix

    B, H, S, splits = 2, 128, 1024, 4
    q = torch.zeros(B, H, 1, 576, dtype=torch.bfloat16)
    latent, rope = torch.zeros(B, 1, S, 512, dtype=torch.bfloat16), torch.zeros(B, 1, S, 64, dtype=torch.bfloat16)
    o_part, scale_part, lse_part = gluon_latent._seesaw_outputs(q, splits, partials)
    kernel = gluon_latent._latent_seesaw_kernel.warmup(
        *gluon_latent._descriptors(q, latent, rope), torch.full((B,), S), o_part, scale_part, lse_part, 0.1, S, H,
        None, num_warps=4, grid=(2, splits, B))
    out, lse = torch.zeros(B * H, 512), torch.zeros(B * H)
    sizes = dict(D=512, SPLITS=triton.next_power_of_2(splits), num_warps=4, grid=(B * H,))
    if scale_part is None:
        merge = triton_prefix._merge_splits_kernel.warmup(o_part, lse_part, out, lse, splits, **sizes)
    else:
        merge = gluon_latent._merge_scaled_kernel.warmup(o_part, scale_part, lse_part, out, lse, splits, **sizes)
    return dict(kernel=dict(shared=kernel.metadata.shared, **ptxas_report(kernel.asm["ptx"])),
                merge=dict(shared=merge.metadata.shared, **ptxas_report(merge.asm["ptx"])))


def main(forms: list[str]) -> None:
    from triton.runtime import driver

    driver.set_active(Hopper())
    print(json.dumps({form: compiled(form) for form in forms}))


if __name__ == "__main__":
    main(sys.argv[1:])
