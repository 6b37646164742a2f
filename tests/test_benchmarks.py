"""The arithmetic and parsing of the GPU benchmark scripts, which CI cannot run."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_e2e  # noqa: E402
import plot_regime  # noqa: E402


def test_ideal_ratio_and_speculative_step():
    # one GPU: W = 5 ms of weights, A = 10 ms of attention at the context; DCP=2 adds C = 0.5 ms
    single = {0: 5e-3, 8192: 15e-3}
    sharded = {0: 5.5e-3, 8192: 10.5e-3}
    (row,) = bench_e2e.rows_for(2, 8, 4, [8192], sharded, single, draft={8192: 2e-3})
    assert row["W_ms"] == pytest.approx(5) and row["A_ms"] == pytest.approx(10) and row["C_ms"] == pytest.approx(0.5)
    assert row["ideal"] == pytest.approx((5 + 5 + 0.5) / 15)
    assert row["ratio"] == pytest.approx(10.5 / 15) and row["off_ideal"] == pytest.approx(0)
    assert row["spec_ratio"] == pytest.approx(12.5 / 17) and row["spec_ideal"] == pytest.approx(12.5 / 17)
    assert "tokens_per_s_per_gpu" not in row  # a verify step's tokens depend on acceptance
    (decode,) = bench_e2e.rows_for(2, 8, 1, [8192], sharded, single)
    assert decode["tokens_per_s_per_gpu"] == dict(dcp1=pytest.approx(8 / 15e-3), dcpn=pytest.approx(8 / 10.5e-3 / 2))


def test_tables_combine_the_dcp_run_with_one_gpu_runs_by_batch_and_tokens():
    # JSON turns the context keys into strings; one-GPU points may come from several runs
    dcp_run = dict(dcp_size=2, reps=20, points=[
        dict(batch=1, tokens=1, contexts=[8192], sharded={"0": 6e-3, "8192": 6.2e-3}),
        dict(batch=8, tokens=4, contexts=[8192], sharded={"0": 6.5e-3, "8192": 7.9e-3})])
    gpu0 = dict(dcp_size=1, reps=20, points=[dict(batch=1, tokens=1, contexts=[8192], single={"0": 5e-3, "8192": 5.5e-3})])
    gpu1 = dict(dcp_size=1, reps=20, points=[dict(batch=8, tokens=4, contexts=[8192],
                                                  single={"0": 5.5e-3, "8192": 7.5e-3}, draft={"8192": 4e-3})])
    n, (decode, verify) = bench_e2e.combine([dcp_run, gpu0, gpu1])
    assert n == 2
    assert (decode["batch"], decode["tokens"], verify["batch"], verify["tokens"]) == (1, 1, 8, 4)
    assert decode["C_ms"] == pytest.approx(1.0) and decode["ratio"] == pytest.approx(6.2 / 5.5)
    assert verify["spec_ratio"] == pytest.approx((7.9 + 4) / (7.5 + 4))
    with pytest.raises(SystemExit, match="exactly one DCP size"):
        bench_e2e.combine([gpu0, gpu1])


def test_a_refused_single_gpu_point_reports_the_sharded_arm_alone():
    (row,) = bench_e2e.rows_for(2, 8, 1, [131072], {0: 6e-3, 131072: 20e-3}, {"refused": "does not fit: ..."})
    assert row["dcp1_ms"] is None and row["dcp1_refused"].startswith("does not fit")
    assert row["tokens_per_s_per_user"] == pytest.approx(50) and row["tokens_per_s_per_gpu"] == pytest.approx(200)


def test_the_regime_plot_reads_the_recorded_log():
    times = plot_regime.read_log(str(BENCHMARKS / "results" / "2026-11-30" / "e2e_decode.log"), batch=8)
    assert sorted(times) == [1, 2]
    assert sorted(times[1]) == sorted(times[2]) == [8192, 16384, 32768, 65536]
    assert times[2][65536] == pytest.approx(13.711)
