"""The correctness gate's rule (exact in fp32, paired in bf16) and `dcp-compile gate` on CPU."""

import json

import pytest

from dcp_compile.cli import main
from dcp_compile.commands.gate import evaluate, homogeneity_chi2

K = 4


def arms(dcp_accepts, off_accepts, same_tokens=True):
    tokens_off = [[i, i + 1] for i in range(len(off_accepts))]
    tokens_dcp = tokens_off if same_tokens else [[i, i + 2] for i in range(len(dcp_accepts))]
    return tokens_dcp, dcp_accepts, tokens_off, off_accepts


def test_fp32_is_exact():
    accepts = [[4, 3, 0], [2, 4, 4], [1, 1]]
    assert evaluate(*arms(accepts, accepts), k=K, dtype="float32").passed
    moved = [[4, 3, 0], [2, 4, 3], [1, 1]]
    result = evaluate(*arms(moved, accepts), k=K, dtype="float32")
    assert not result.passed and "accept counts differ" in result.why
    result = evaluate(*arms(accepts, accepts, same_tokens=False), k=K, dtype="float32")
    assert not result.passed and "tokens differ in 3 of 3 requests" in result.why


def test_bf16_passes_a_tight_interval_and_fails_a_shifted_one():
    base = [[(i * 7 + j) % (K + 1) for j in range(40)] for i in range(300)]
    one_step_moved = [row[:-1] + [(row[-1] + 1) % (K + 1)] if i % 10 == 0 else row for i, row in enumerate(base)]
    result = evaluate(*arms(one_step_moved, base, same_tokens=False), k=K, dtype="bfloat16")
    low, high = result.ratio_interval
    assert result.passed, result.why
    assert 0.99 <= low <= result.ratio <= high <= 1.01 and result.token_identity_rate == 0
    shorter = [[max(a - 1, 0) for a in row] for row in base]
    result = evaluate(*arms(shorter, base), k=K, dtype="bfloat16")
    assert not result.passed and "is not inside [0.99, 1.01]" in result.why
    assert "histograms differ" in result.why


def test_few_requests_give_a_wide_interval():
    base = [[4, 4, 2], [3, 1, 4], [0, 4, 4]]
    moved = [[4, 4, 2], [3, 2, 4], [0, 4, 4]]
    result = evaluate(*arms(moved, base), k=K, dtype="bfloat16")
    assert not result.passed and result.ratio_interval[1] > 1.01


def test_homogeneity_statistic():
    assert homogeneity_chi2([10, 20, 30], [10, 20, 30]) == (0.0, 2)
    chi2, dof = homogeneity_chi2([50, 0, 50], [0, 100, 0])
    assert dof == 2 and chi2 > 100
    assert homogeneity_chi2([0, 5, 0], [0, 7, 0]) == (0.0, 0), "one used bin: nothing to compare"


def test_requests_must_pair():
    with pytest.raises(ValueError, match="the gate pairs requests"):
        evaluate([[1]], [[0]], [], [], k=K, dtype="float32")


def test_gate_command_on_two_cpu_ranks_in_fp32(capsys):
    code = main(["gate", "--dcp", "2", "--prompts", "4", "--batch", "2", "--prompt-bytes", "48",
                 "--max-new-tokens", "16", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["passed"] and summary["rule"] == "exact" and summary["dtype"] == "float32"
    assert summary["requests"] == 4 and summary["token_identity_rate"] == 1.0
    assert sum(summary["histogram_dcp"]) == sum(summary["histogram_off"]) > 0


def test_gate_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gate", "--prompts", "0"])
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
