import json
import subprocess
import sys

import pytest

from dcp_compile.runtime.launch import free_port


def run_demo(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "dcp_compile.cli", "demo", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_spawns_two_ranks_and_reports_parity():
    proc = run_demo("--json", "--lowering", "aot_eager", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["dcp_size"] == 2 and summary["tokens_identical"] is True
    assert summary["new_tokens"] == 3 * 9
    assert summary["max_abs_logit_diff"] < 1e-4


@pytest.mark.inductor
def test_demo_default_prints_tokens_and_parity_line():
    proc = run_demo("--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DCP group of 2 (gloo, cpu)" in proc.stdout
    assert "parity vs size-1 arm: tokens identical = True" in proc.stdout


def test_demo_rejects_bad_flags():
    proc = run_demo("--dcp", "0")
    assert proc.returncode == 2 and "--dcp and --max-new-tokens must be >= 1" in proc.stderr


def test_demo_runs_as_one_rank_under_torchrun():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "dcp_compile.cli", "demo", "--json", "--lowering", "aot_eager", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "only rank 0 reports"
    summary = json.loads(lines[0])
    assert summary["dcp_size"] == 2 and summary["tokens_identical"] is True
