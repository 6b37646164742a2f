"""The core imports without transformers; dcp_compile.hf says how to get it."""

import subprocess
import sys

BLOCK_TRANSFORMERS = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("transformers hidden for this test")

sys.meta_path.insert(0, Block())
import dcp_compile, dcp_compile.cli, dcp_compile.runtime.spec, dcp_compile.models
assert "transformers" not in sys.modules
try:
    import dcp_compile.hf
except ImportError as error:
    assert "dcp-compile[hf]" in str(error), error
    print("ok")
"""


def test_core_imports_without_transformers():
    out = subprocess.run([sys.executable, "-c", BLOCK_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
