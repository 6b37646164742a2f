"""Run ``prefix_attention_triton`` on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET`` is read when ``triton`` is imported, so the interpreter gets a
process of its own:

    TRITON_INTERPRET=1 python tests/ops/triton_interpret.py CASES.pt RESULTS.pt [OP]

``CASES.pt`` maps a case name to the op's arguments (a dict); ``RESULTS.pt`` maps it to
``(out, lse)``.  tests/ops/test_triton_prefix.py writes the cases, runs this, and
compares the results with the float64 reference; ``benchmarks/bench_kernel.py --smoke``
uses ``patch_interpreter`` too.
"""

from __future__ import annotations

import importlib
import os
import sys


def patch_interpreter() -> None:
    """Fix two faults of Triton 3.6's interpreter that the kernel hits (the compiled
    kernel is not affected; later Triton releases fix the first):

    - a scalar is a one-element array there, and ``int(array)`` of it, which runs for
      every loop with a runtime bound, raises under NumPy >= 2.4;
    - ``tl.dot`` multiplies bf16 operands as their raw uint16 bit patterns.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def bf16_as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16  # bf16 is the top half of an fp32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, bf16_as_fp32(a), bf16_as_fp32(b), d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patch_tensor_index
    interpreter.InterpreterBuilder.create_dot = create_dot_bf16


def main(cases_path: str, results_path: str, op: str = "prefix_attention_triton") -> None:
    """``op``: which of ``dcp_compile.ops``'s Triton ops the cases call, or a function of
    one of its modules (``module.function``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 in the environment (it is read when triton is imported)")
    import torch

    patch_interpreter()
    import dcp_compile.ops

    module, _, name = op.rpartition(".")
    kernel = getattr(importlib.import_module(f"dcp_compile.ops.{module}") if module else dcp_compile.ops, name)
    cases = torch.load(cases_path)
    results = {name: kernel(**args) for name, args in cases.items()}
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
