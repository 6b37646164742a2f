"""The arithmetic and parsing of the GPU benchmark scripts, which CI cannot run."""

import json
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


# bench_e2e's stderr as a run leaves it: decode steps (T 1) of two sizes and two batches,
# plus lines the plot must skip (the context-0 baseline, a verify step, a refusal, the
# draft's timing, the scheduler's timeout).
E2E_LOG = """\
[00:04:25] size 2 batch 8 T 1 context 0: 6.037 ms
[00:04:25] size 2 batch 8 T 1 context 8192: 7.624 ms
[00:04:26] size 2 batch 8 T 1 context 65536: 13.711 ms
[00:04:27] size 2 batch 8 T 4 context 8192: 9.250 ms
[00:04:28] size 2 batch 1 T 1 context 8192: 6.820 ms
[00:05:10] draft batch 8 k 3 context 8192: extend 1.250 ms, step 2.500 ms
[00:06:49] size 1 batch 8 T 1 context 8192: 8.657 ms
[00:06:50] size 1 batch 8 T 1 context 65536: 20.490 ms
[00:06:51] size 1 batch 16 T 1: refused by the plan: does not fit
Timeout (0:09:15)!
"""


def test_the_regime_plot_reads_decode_steps_from_a_log(tmp_path):
    log = tmp_path / "e2e_decode.log"
    log.write_text(E2E_LOG)
    assert plot_regime.read_log(str(log), batch=8) == {
        2: {8192: pytest.approx(7.624), 65536: pytest.approx(13.711)},
        1: {8192: pytest.approx(8.657), 65536: pytest.approx(20.49)},
    }
    assert plot_regime.read_log(str(log), batch=1) == {2: {8192: pytest.approx(6.82)}}
    assert plot_regime.read_log(str(log), batch=16) == {}


def test_the_regime_plot_adds_refused_points_from_the_json(tmp_path):
    log = tmp_path / "e2e_decode.log"
    log.write_text(E2E_LOG)
    summary = tmp_path / "e2e.json"
    summary.write_text(json.dumps(dict(dcp_size=2, rows=[
        dict(batch=16, tokens=1, context=131072, dcp1_ms=None, dcpn_ms=30.5),  # one GPU refused: drawn
        dict(batch=8, tokens=1, context=8192, dcp1_ms=8.6, dcpn_ms=7.6),  # in the log already
        dict(batch=16, tokens=4, context=131072, dcp1_ms=None, dcpn_ms=41.0),  # a verify step
    ])))
    times, refused = plot_regime.read_inputs([str(log), str(summary)])
    assert times == {
        (2, 8): {8192: pytest.approx(7.624), 65536: pytest.approx(13.711)},
        (2, 1): {8192: pytest.approx(6.82)},
        (1, 8): {8192: pytest.approx(8.657), 65536: pytest.approx(20.49)},
        (2, 16): {131072: pytest.approx(30.5)},
    }
    assert refused == [(16, 131072)]


def test_regional_compile_runs_every_layer_through_one_graph_and_matches_the_eager_model():
    """bench_e2e --regional: one layer graph serves every layer of the MLA target, and the
    step through the cascade (a group of one) equals the same model run eagerly."""
    import dataclasses

    import torch

    import dcp_compile as dcp

    cfg, device = bench_e2e.target_config(True, layers=3, model="v2lite")
    cfg = dataclasses.replace(cfg, max_batch=2, max_seq_len=40)
    group = dcp.DCPGroup(1, 0, device, None)
    model = bench_e2e.build(cfg, group, device, seed=3)
    eager = bench_e2e.build(cfg, group, device, seed=3)  # the same weights and random caches
    timed = bench_e2e.step_timer(model, group, device, batch=2, tokens=1, reps=1, deterministic=None, regional=True)
    assert timed(7) > 0
    assert all(type(layer).__name__ == "OptimizedModule" for layer in model.layers)
    with torch.no_grad():
        for tokens, position in ((torch.tensor([[4], [6]]), 0), (torch.tensor([[1], [2]]), 7), (torch.tensor([[3], [5]]), 8)):
            # 0 and 7 first: they rewrite the slots the compile and the timed steps wrote with their own tokens
            positions = torch.full((2, 1), position)
            torch.testing.assert_close(model.forward(tokens, positions), eager(tokens, positions), rtol=1e-4, atol=1e-4)


def test_the_latent_kernel_benchmark_runs_under_the_interpreter(tmp_path):
    import subprocess

    out = tmp_path / "latent.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_latent_kernel.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["correct"] is True
    assert [(p["heads"], p["t"]) for p in result["points"]] == [(4, 1), (4, 4)]
    for point in result["points"]:
        assert {"ours", "einsum", "sdpa", "copy"} <= set(point["arms"])
        assert all(arm["ms"] > 0 for arm in point["arms"].values())
        assert point["arms"]["ours"]["tflops"] > 0 and "pct_copy" in point["arms"]["ours"]
    (verify,) = result["verify"]
    assert verify["t"] == 4 and verify["per_token_ms"] == pytest.approx(verify["verify_ms"] / 4)
    swept = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_latent_kernel.py"), "--smoke", "--sweep",
                           "--sweep-tiles", "block_s=16,64", "num_warps=4", "num_stages=2", "--out", str(swept)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep,) = json.loads(swept.read_text())["sweeps"]
    assert [r["block_s"] for r in sorted(sweep["results"], key=lambda r: r["block_s"])] == [16, 64]
    assert [r["ms"] for r in sweep["results"]] == sorted(r["ms"] for r in sweep["results"])
    windowed = tmp_path / "window.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_latent_kernel.py"), "--smoke", "--window",
                           "--rounds", "1", "--out", str(windowed)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (window,) = json.loads(windowed.read_text())["windows"]
    assert (window["heads"], window["t"]) == (4, 96) and set(window["arms"]) == {"in_order", "all_equal"}
    assert window["in_order_over_all_equal"] == pytest.approx(
        window["arms"]["in_order"]["ms"] / window["arms"]["all_equal"]["ms"])


def test_the_hf_one_gpu_benchmark_runs_transformers_latent_attention_both_ways():
    """``gpu_hf.py --one-gpu --family deepseek-v2-lite`` at its CPU size: transformers'
    DeepSeek-V2 compiled with the cascade and plainly, on the same cache contents, gives
    the same fp32 logits, and the report's rows and ratios are what it timed."""
    import subprocess

    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_hf.py"), "--small", "--one-gpu", "--family",
                           "deepseek-v2-lite"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["family"] == "deepseek-v2-lite" and report["dcp_size"] == 1 and "parity" not in report
    assert [(row["context"], row["batch"]) for row in report["step_time"]] == [(64, 1), (64, 2), (128, 1), (128, 2)]
    for row in report["step_time"]:
        assert (row["cascade_sites"], row["plain_sites"]) == (2, 0)  # both layers in the cascade, or none
        assert row["max_logit_gap"] < 1e-4 and row["argmax_agreement"] == 1.0
        assert row["cascade_ms"] > 0 and row["plain_ms"] > 0
        assert row["ratio"] == pytest.approx(row["cascade_ms"] / row["plain_ms"], abs=2e-3)


def test_the_verify_width_benchmark_reports_the_chosen_kernel_against_both(tmp_path):
    import subprocess

    out = tmp_path / "verify_width.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_verify_width.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["batch"], p["tokens"]) for p in points] == [(1, 4), (1, 24), (2, 4), (2, 24)]
    for p in points:
        assert p["choice"] == "split"  # interpreter runs assume 132 SMs: a few tiles never fill them
        assert p["chosen_over_best"] == pytest.approx(p["chosen_ms"] / min(p["split_ms"], p["flash_ms"]), abs=2e-3)
    assert [p["chosen_over_narrowest"] for p in points if p["tokens"] == 4] == [1.0, 1.0]


def test_the_hf_generate_speed_benchmark_times_both_arms_at_cpu_size():
    """``gpu_hf_generate_speed.py --small``: both arms on every width and batch kind, the
    ratios computed from what was timed, and a new width compiling nothing."""
    import subprocess

    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_hf_generate_speed.py"), "--small"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    keys = ["40/padded", "40/full", "90/padded", "90/full"]
    assert list(report["dcp"]) == list(report["transformers"]) == keys
    assert all(report["dcp"][key]["graphs"] == 0 for key in keys)  # no compile after the warm-up
    assert report["first_logits_vs_transformers_eager"]["dcp"] < 1e-4  # fp32 on CPU
    assert report["argmax_equal_to_eager"]["dcp"] == report["argmax_equal_to_eager"]["of"] == 4
    for key in keys:
        assert report["dcp_over_transformers"][key]["call"] == pytest.approx(
            report["dcp"][key]["call_s"] / report["transformers"][key]["call_s"], abs=2e-3)


def test_the_tree_accept_table_matches_the_chain_of_dcp_compile_eval(tmp_path):
    """``tree_accept_table.py --quick``: the cacheless chain gives the accept counts of
    ``dcp-compile eval`` on the same prompts, the paths scoring agrees with the table's,
    and every quick configuration has a row."""
    import subprocess

    out = tmp_path / "tree.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "tree_accept_table.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["chain_check"]["passed"] is True and report["paths_check"]["agree"] is True
    assert report["chain_check"]["reference"] == pytest.approx(report["chain_check"]["eval"])
    rows = report["configs"]
    assert [(r["k"], r["topk"], r["draft_tokens"]) for r in rows] == [(3, 1, 3), (3, 2, 8), (3, 4, 16)]
    for r in rows:
        assert r["verify_tokens"] == r["draft_tokens"] + 1 and sum(r["accept_histogram"]) == r["verify_steps"]
        assert 1 <= r["accept_length"] <= r["k"] + 1
        assert r["accept_length"] == pytest.approx(r["mean_accepted"] + 1)


def test_the_tree_step_benchmark_times_a_chain_and_a_tree_at_cpu_size(tmp_path):
    """``bench_tree_step.py --small``: a row per shape and context, the expected tokens/s
    computed from the step it timed and the accept length it was given."""
    import subprocess

    out = tmp_path / "tree_step.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_tree_step.py"), "--small", "--device", "cpu",
                           "--lowering", "aot_eager", "--batches", "2", "--contexts", "64", "--shapes", "3,1,3", "3,2,5",
                           "--accept", "3,2,5=2.5", "--reps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["k"], r["topk"], r["draft_tokens"], r["context"]) for r in rows] == [(3, 1, 3, 64), (3, 2, 5, 64)]
    assert all(r["step_ms"] > 0 and r["step_calls_ms"] > 0 for r in rows) and "tokens_per_s" not in rows[0]
    assert rows[1]["tokens_per_s"] == pytest.approx(2 * 2.5 / (rows[1]["step_ms"] / 1e3))
