"""The benchmark suite's harness and the GPU check's dry mode (the CPU and torch's Lazy
device, about a minute)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def gpu_dry(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--json", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "DRY ALL OK" in p.stdout
    report = json.loads(out.read_text())
    report["_stdout"] = p.stdout
    return report


def test_gpu_check_dry_backend_is_native_on_cpu(gpu_dry):
    assert gpu_dry["info"]["dry"] is True
    b = gpu_dry["sections"]["backend"]
    assert b["status"] == "ok" and b["ok"] is True
    assert b["cpu"] == "Native"
    if not gpu_dry["info"]["cuda_available"]:
        assert b["cuda"].startswith("skipped")


def test_gpu_check_dry_graph_ops(gpu_dry):
    g = gpu_dry["sections"]["graph_ops"]
    assert g["status"] == "ok" and g["ok"] is True
    bn, st = g["bnswap"], g["stock"]
    assert "aten._batch_norm_with_update.default" in bn["export"]
    assert bn["export_decomposed"] == ["aten._batch_norm_with_update_functional.default"]
    assert bn["joint"] == [
        "aten._batch_norm_with_update_functional.default",
        "aten.batch_norm_backward.default",
    ]
    # training IR: stock keeps the legacy composite (aten.batch_norm in torch 2.13)
    assert st["export"] and not any("_batch_norm_with_update" in o for o in st["export"])
    assert st["export_decomposed"] == ["aten._native_batch_norm_legit_functional.default"]
    # the default (core ATen) table: bnswap's program reaches stock's core ATen ops
    assert (
        bn["export_core_aten"]
        == st["export_core_aten"]
        == ["aten._native_batch_norm_legit_functional.default"]
    )
    assert st["joint"] == [
        "aten._native_batch_norm_legit_functional.default",
        "aten.native_batch_norm_backward.default",
    ]
    # evaluation: a converted model's program is stock's (docs/design.md, "The evaluation op")
    assert bn["export_eval"] == st["export_eval"] == ["aten.batch_norm.default"]


#: bnswap's values against stock's reference in dry mode (stock on the CPU; the Lazy
#: device runs the same kernels, through its TorchScript backend)
TOL = 1e-5


def _values_close(diffs: dict) -> bool:
    return bool(diffs) and all(isinstance(d, float) and d <= TOL for d in diffs.values())


def test_gpu_check_dry_runs_every_cpu_path_and_says_what_it_skipped(gpu_dry):
    s = gpu_dry["sections"]
    assert s["compile_inductor"]["status"].startswith("skipped")
    assert "[SKIP ] compile_inductor" in gpu_dry["_stdout"]
    # a stock program converted by bnswap.convert: the consolidated op in training,
    # bitwise on the CPU, moved with move_to_device_pass to the Lazy device, where it
    # computes stock's program's values
    c = s["converted_program"]
    assert c["graph_ops"]["stock"] == ["aten.batch_norm.default"]
    assert c["graph_ops"]["bnswap"] == ["aten._batch_norm_with_update.default"]
    assert c["bitwise_equal_on_cpu"] is True and c["ok"] is True
    assert c["bnswap"]["ran_on"] == c["stock"]["ran_on"] == "lazy"
    assert _values_close(c["vs_stock"]) and set(c["vs_stock"]) == {"outputs", "state"}
    # the exported joint graph trains exactly like eager on the CPU (same native kernel)
    t = s["training"]["summary"]
    assert t["exported_bnswap"]["max_abs_diff_vs_eager"] == 0.0
    assert t["exported_stock"]["max_abs_diff_vs_eager"] == 0.0
    # the synchronized layer over a one-rank gloo group: stock BatchNorm's result, with
    # ATen's CPU kernels in its slots (what the plan's kernel column says) and without;
    # it normalizes with stock's evaluation call, aten::batch_norm (training=False)
    sy = s["sync"]
    assert sy["backend"] == "gloo" and sy["ok"] is True and sy["kernel_column"] == "Sync (Native)"
    assert sy["normalization_ok"] is True
    assert sy["bnswap"]["aten_ops"] == [
        "aten::_batch_norm_impl_index",
        "aten::batch_norm",
        "aten::batch_norm_update_stats",
        "aten::native_batch_norm",
        "aten::native_batch_norm_backward",
    ]
    assert sy["bnswap_portable"]["aten_ops"] == [
        "aten::_batch_norm_impl_index",
        "aten::batch_norm",
        "aten::native_batch_norm",
    ]
    assert max(sy["max_abs_diff_vs_batchnorm"], sy["max_abs_diff_vs_batchnorm_portable"]) < 1e-5
    assert gpu_dry["all_ok"] is True


@pytest.mark.parametrize("section", ["eager", "compile_aot_eager"])
def test_gpu_check_dry_runs_both_modes_on_the_lazy_device(gpu_dry, section):
    """Issue 44: eager mode and torch.compile's AOT graphs, training AND evaluation, run on
    torch's Lazy device (a device other than the CPU whose dispatch is CUDA's: the old
    evaluation op, whose kernel calls batch_norm_cpu, raises there), bnswap's losses, state
    and evaluation outputs equal to stock's (on the CPU) within 1e-5."""
    r = gpu_dry["sections"][section]
    assert r["status"] == "ok" and r["ok"] is True, r.get("status")
    assert r["ran_on_expected"] == "lazy"
    for mode in ("train", "eval"):
        for name in ("bnswap", "stock"):
            assert r[mode][name]["ran_on"] == ["lazy"], (mode, name)
    assert _values_close(r["vs_stock"])
    assert set(r["vs_stock"]) == {"losses", "state", "eval_outputs"}
    bn_train, bn_eval = r["train"]["bnswap"]["aten_ops"], r["eval"]["bnswap"]["aten_ops"]
    assert "aten::batch_norm_backward" in bn_train and "aten::_batch_norm_with_update" in bn_train
    assert not any("no_update" in o for o in bn_train + bn_eval)
    # evaluation: the same ops as stock's (eager: stock's call; AOT graphs: the native op
    # aten.batch_norm decomposes to, for both)
    assert bn_eval == r["eval"]["stock"]["aten_ops"]
    if section == "eager":
        assert "aten::batch_norm" in bn_eval
        assert "aten::native_batch_norm_backward" in r["train"]["stock"]["aten_ops"]
    else:
        assert "aten::_native_batch_norm_legit_no_training" in bn_eval
        assert "aten::_native_batch_norm_legit_functional" in r["train"]["stock"]["aten_ops"]
    # what torch's rule predicts on CUDA for each (checked against the profiler there)
    assert r["train"]["bnswap"]["predicted"] == ["cudnn"]
    assert r["eval"]["bnswap"]["predicted"] == r["eval"]["stock"]["predicted"]
    assert "ran on the Lazy device" in r["note"]


def test_gpu_check_dry_moves_exported_graphs_to_the_lazy_device(gpu_dry):
    """Graphs captured on the CPU, moved as users move them (ep.module().to(device),
    graph_module.to(device)), run on the Lazy device with the reference's values."""
    e = gpu_dry["sections"]["exported"]
    assert e["status"] == "ok" and e["ok"] is True and e["moved_to"] == "lazy"
    for part in ("forward_decomposed", "joint"):
        assert {k: e[part][k]["ran_on"] for k in ("bnswap", "stock")} == {
            "bnswap": "lazy",
            "stock": "lazy",
        }
        assert e[part]["predicted"] == {"bnswap": ["cudnn"], "stock": ["native"]}
    assert "aten::batch_norm_backward" in e["joint"]["bnswap"]["aten_ops"]
    assert _values_close(e["vs_stock"])
    assert set(e["vs_stock"]) == {"forward_outputs", "forward_state", "joint_losses", "joint_state"}


def test_gpu_check_dry_moves_every_kind_of_layer_as_users_do(gpu_dry):
    """Guards issue 25's and issue 44's GPU check: every affine x track_running_stats
    combination, train and eval, three programs (stock's, a converted model exported,
    bnswap.convert of stock's), moved with ep.module().to(device) and
    move_to_device_pass, and the joint graph with graph_module.to(device): each runs on
    the Lazy device, bnswap's outputs and state (the joint graph's losses and state) equal
    to stock's program run on the CPU. In evaluation with running statistics bnswap's
    programs run stock's aten::batch_norm; with batch statistics its consolidated op."""
    m = gpu_dry["sections"]["moved_programs"]
    assert m["status"] == "ok" and m["ok"] is True and m["moved_to"] == "lazy"
    assert len(m["cases"]) == 8
    for key, case in m["cases"].items():
        train = key.endswith(",train")
        moves = ("module_to", "move_to_device_pass") + (("joint",) if train else ())
        for move in moves:
            progs = (
                ("bnswap_exported", "stock")
                if move == "joint"
                else ("bnswap_exported", "bnswap_converted", "stock")
            )
            for prog in progs:
                assert case[move][prog]["ran_on"] == "lazy", (key, move, prog)
            bn_ops = case[move]["bnswap_exported"]["aten_ops"]
            assert not any("no_update" in o for o in bn_ops), (key, move, bn_ops)
            if train or "track_running_stats=False" in key:  # batch statistics
                assert "aten::_batch_norm_with_update" in bn_ops, (key, move, bn_ops)
            else:  # running statistics: stock's call
                assert bn_ops == case[move]["stock"]["aten_ops"], (key, move, bn_ops)
                assert "aten::batch_norm" in bn_ops, (key, move, bn_ops)
        assert _values_close(case["vs_stock"]), (key, case["vs_stock"])
        # outputs and state of 2 programs x 2 moves (+ the joint graph's losses and state)
        assert len(case["vs_stock"]) == (10 if train else 8), key


def test_gpu_check_dry_rehearses_synchronized_layers_on_two_processes(gpu_dry):
    """Issue 44: the 2-GPU synchronized check's code path, rehearsed with 2 spawned gloo
    processes on the CPU: each rank's share of an uneven global batch through a swapped
    SyncBatchNorm, forward + backward then evaluation, against one process's stock
    BatchNorm on the global batch; each rank normalizes with aten::batch_norm."""
    r = gpu_dry["sections"]["sync_two_ranks"]
    assert r["status"] == "ok" and r["ok"] is True, r.get("status")
    assert r["backend"] == "gloo" and r["world"] == 2 and r["batch_per_rank"] == [3, 5]
    assert [rank["device"] for rank in r["ranks"]] == ["cpu", "cpu"]
    assert set(r["max_abs_diff"]) == {
        "out",
        "grad_input",
        "grad_weight",
        "grad_bias",
        "state",
        "eval_out",
    }
    assert all(d < 1e-5 for d in r["max_abs_diff"].values()), r["max_abs_diff"]
    assert r["normalization_ok"] is True
    for rank in r["ranks"]:
        # the device's statistics kernel in its slot, stock's evaluation call to normalize
        assert "aten::batch_norm_update_stats" in rank["aten_ops"]
        assert "aten::batch_norm" in rank["aten_ops"]
        assert "aten::_batch_norm_no_update" not in rank["aten_ops"]
    assert "[PASS ] sync_two_ranks" in gpu_dry["_stdout"]


def test_gpu_check_moves_graphs_as_users_do_and_rewrites_no_device_keyword():
    """Issue 25: nothing in the GPU check (or the package) rewrites a graph's device
    keywords before running it; the GPU check moves programs as users do."""
    text = (ROOT / "benchmarks" / "gpu_check.py").read_text()
    assert "_retarget" not in text and 'kwargs["device"]' not in text
    assert ".module().to(self.target)" in text and "move_to_device_pass(" in text
    for path in (ROOT / "bnswap").rglob("*.py"):
        assert '"device":' not in path.read_text(), path


def test_gpu_check_dry_qat_pt2e_prepared_graphs(gpu_dry):
    """The pt2e QAT section (issue 31; issue 45): bnswap's prepared graph is stock's,
    aten.batch_norm; a few QAT steps of each agree bitwise on the CPU, with the same ops."""
    q = gpu_dry["sections"]["qat_pt2e"]
    if "torchao is not installed" in q.get("note", ""):
        pytest.skip(q["note"])
    assert q["status"] == "ok" and q["ok"] is True, q
    assert q["graph_ops"] == {
        "bnswap": ["aten.batch_norm.default"],
        "stock": ["aten.batch_norm.default"],
    }
    assert q["losses"]["bnswap"] == q["losses"]["stock"] and len(q["losses"]["stock"]) == 4
    assert "aten::native_batch_norm_backward" in q["bnswap"]["aten_ops"]
    assert q["bnswap"]["aten_ops"] == q["stock"]["aten_ops"]
    assert q["predicted"] == {"bnswap": ["cudnn"], "stock": ["cudnn"]}
    assert "[PASS ] qat_pt2e" in gpu_dry["_stdout"]


def test_gpu_check_dry_fsdp2_bfloat16_step(gpu_dry):
    """FSDP2 param_dtype=bfloat16 on a one-rank gloo group: stock raises, bnswap trains,
    its output equals stock BatchNorm's on the float32-held bfloat16 weights."""
    f = gpu_dry["sections"]["fsdp2_bf16"]
    assert f["status"] == "ok" and f["ok"] is True
    assert f["stock"]["error"] == "expected scalar type BFloat16 but found Float"
    assert "aten::batch_norm_backward" in f["bnswap"]["aten_ops"]
    assert f["reference"]["max_abs_diff"] == 0.0
    assert f["reference"]["running_var_dtype"] == "torch.float32"


def test_bench_sync_quick_reports_the_floor_and_the_breakdown(tmp_path):
    """benchmarks/bench_sync.py (issue 28) --quick (a 3-layer net, 2 gloo ranks, 3 rounds),
    its report read back: the four variants' times, the synchronized step's extra as a
    multiple of the floor's (wall, CPU) and sync / floor CPU time with their intervals, the
    verdict following from them, the profiler breakdown, and the floor issuing exactly
    the synchronized step's collectives. The figures themselves are the benchmark's."""
    stem = tmp_path / "sync"
    from tests._helpers import run_processes  # (spawned ranks: the whole session is killed)

    p = run_processes(
        [sys.executable, "-m", "benchmarks.bench_sync", "--quick", "--out", str(stem)],
        300,
        env=_env(),
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["backward_collective"] in ("all_gather", "all_reduce")
    r = doc["results"]["2"]["tiny"]
    assert r["bn_layers"] == 3 and r["rounds"] == 3
    assert all(
        _finite_pos(r["ms"][k]) and _finite_pos(r["cpu_ms"][k])
        for k in ("unsync", "floor", "sync", "collectives")
    )
    for key in (
        "extra_over_floor_extra",
        "cpu_extra_over_floor_extra",
        "cpu_sync_over_floor",
        "sync_over_unsync",
        "floor_over_unsync",
    ):
        lo, hi = r[key]["ci95"]
        assert lo <= r[key]["median"] <= hi, key
    assert r["goal_met"] == (
        r["extra_over_floor_extra"]["median"] <= 1.1 and r["cpu_sync_over_floor"]["median"] <= 1.1
    )
    assert r["extra_ratio_of_medians"] == pytest.approx(
        (r["ms"]["sync"] - r["ms"]["unsync"]) / (r["ms"]["floor"] - r["ms"]["unsync"])
    )
    # the floor is the synchronized step's collectives: the same gloo events, one
    # all_gather forward and one backward collective a layer
    counts = r["collectives_per_step"]
    assert counts["floor"] == counts["sync"] != counts["unsync"]
    assert sum(counts["collectives"].values()) == 2 * r["bn_layers"]
    # what bnswap.sync did not keep, timed in the same rounds, each over the sync step
    other = "all_reduce" if doc["backward_collective"] == "all_gather" else "all_gather"
    assert set(r["alternatives"]) == {
        "own process group",
        f"backward {other}",
        "functional collectives",
    }
    for alt, v in r["alternatives"].items():
        for part in ("wall", "cpu"):
            lo, hi = v[part]["ci95"]
            assert 0 < lo <= v[part]["median"] <= hi, (alt, part)
    assert counts[f"sync, backward {other}"].get(f"gloo:{other}", 0) >= r["bn_layers"]
    b = r["breakdown"]
    for part in ("forward", "backward"):
        assert b["sync"][f"sync {part}"] > 0
        assert 0 < b["sync"][f"sync {part}: collectives and waiting"] <= b["sync"][f"sync {part}"]
    assert b["floor"]["floor hooks: collectives and waiting"] > 0
    assert b["unsync"]["stock BatchNorm: _batch_norm_with_update"] > 0
    md = stem.with_suffix(".md").read_text()
    assert "| 2 | tiny | 3 |" in md and "sync forward: statistics kernel" in md


def test_kernel_name_classification():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import classify_kernel
    finally:
        sys.path.pop(0)
    assert (
        classify_kernel(
            "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1, true>(...)"
        )
        == "cudnn"
    )
    assert (
        classify_kernel(
            "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>(...)"
        )
        == "cudnn"
    )
    assert (
        classify_kernel("void cudnn::batchnorm_fwtr_nhwc_semiPersist<float, float, 512>(...)")
        == "cudnn"
    )
    assert (
        classify_kernel("void at::native::batch_norm_collect_statistics_kernel<...>(...)")
        == "native"
    )
    assert (
        classify_kernel("void at::native::batch_norm_backward_kernel<float, float>(...)")
        == "native"
    )
    assert (
        classify_kernel("void at::native::batch_norm_transform_input_kernel<...>(...)") == "native"
    )
    assert classify_kernel("triton_red_fused__native_batch_norm_legit_functional_0") == "triton"
    assert classify_kernel("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nchw") is None
    assert classify_kernel("void cudnn::ops::nchwToNhwcKernel<float, float>(...)") is None


def _gpu_check(monkeypatch):
    """benchmarks/gpu_check.py as a module (its folder stays on sys.path for the test:
    processes it spawns import it by name)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    return gpu_check


def test_gpu_check_fails_loudly_naming_the_section(monkeypatch, tmp_path, capsys):
    """An error in any section: its [ERROR] line, its traceback on stderr, PROBLEMS naming
    it, exit status 1, the JSON written; a section that cannot run here (Skipped, as the
    2-GPU check with fewer GPUs) says why and is no failure. (A section is made to raise
    here; the dry run with the old evaluation op planted fails the same way, in eager,
    compile_aot_eager, moved_programs and graph_ops.)"""
    import torch

    gc = _gpu_check(monkeypatch)

    def broken(self):
        raise RuntimeError("planted failure")

    def not_here(self):
        raise gc.Skipped("needs 2 GPUs, 0 present")

    monkeypatch.setattr(gc.Check, "graph_ops", broken)
    monkeypatch.setattr(gc.Check, "sync_two_ranks", not_here)
    threads = torch.get_num_threads()
    path = tmp_path / "gpu.json"
    try:
        rc = gc.main(
            ["--dry", "--sections", "backend,graph_ops,sync_two_ranks", "--json", str(path)]
        )
        out, err = capsys.readouterr()
        rc_skip_only = gc.main(
            ["--dry", "--sections", "backend,sync_two_ranks", "--json", str(path)]
        )
        out_skip_only, _ = capsys.readouterr()
    finally:
        torch.set_num_threads(threads)
    assert rc == 1
    assert "[ERROR] graph_ops          error: RuntimeError: planted failure" in out
    assert "DRY PROBLEMS: graph_ops in" in out
    assert "--- graph_ops failed:" in err and 'raise RuntimeError("planted failure")' in err
    assert "[SKIP ] sync_two_ranks     skipped: needs 2 GPUs, 0 present" in out
    assert rc_skip_only == 0 and "DRY ALL OK" in out_skip_only
    report = json.loads(path.read_text())  # (the second run's)
    assert report["all_ok"] is True and report["problems"] == []
    assert report["sections"]["sync_two_ranks"]["status"] == "skipped: needs 2 GPUs, 0 present"


def test_gpu_check_kills_ranks_that_hang(monkeypatch, tmp_path):
    """Processes of the 2-rank check that never finish (here: a rendezvous for 3 ranks
    that 2 join) are killed at the timeout, and the error names them: a hung collective
    cannot hang the GPU check."""
    gc = _gpu_check(monkeypatch)
    args = (3, "gloo", str(tmp_path / "store"), str(tmp_path / "data.pt"), str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 still running after 8 s: killed"
    ):
        gc.run_ranks(gc.sync_rank, args, 2, 8)
    assert time.perf_counter() - t0 < 8 + 25  # (killed, then joined)


def _finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_suite_quick_writes_json_md_png_with_sane_numbers(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--cases",
            "P3,P5,P6",
            "--pairs",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # progress: which case runs (of how many) and an estimate of the time left
    assert "P3 (1 of 3: layer over the raw op) ... (about" in p.stdout
    assert "P6 (3 of 3: peak memory) ... (about" in p.stdout
    res = json.loads((tmp_path / "latest.json").read_text())
    assert (tmp_path / "latest.png").stat().st_size > 10_000
    md = (tmp_path / "latest.md").read_text()
    assert "## P3" in md and "## P5" in md and "torch" in md
    assert res["schema"] == 1 and res["config"]["quick"] is True
    m = res["machine"]
    assert m["torch_threads"] >= 1 and m["torch"] and m["cpu"]
    cases = res["cases"]
    assert set(cases) == {"P3", "P5", "P6"}
    # P3: overhead rows at both sizes and both passes, with positive finite figures
    p3 = cases["P3"]
    assert p3["status"] == "ok"
    assert {(r["size"], r["mode"]) for r in p3["rows"]} == {
        (s, m) for s in ("tiny", "resnet") for m in ("forward", "forward+backward")
    }
    for r in p3["rows"]:
        assert _finite_pos(r["ratio_median"]) and _finite_pos(r["a_median_ms"])
        lo, hi = r["ratio_ci95"]
        assert lo <= r["ratio_median"] <= hi
    for r in p3["bandwidth"]:
        assert _finite_pos(r["op_gbps"]) and _finite_pos(r["clone_gbps"])
    # P3's dispatcher rows: stock and swapped layers through it, and the A/A control,
    # in both modes, each with its extra time per call
    assert [(r["mode"], r["compare"].split(":")[0].split(" ")[0]) for r in p3["dispatcher"]] == [
        (m, c) for m in ("train", "eval") for c in ("stock", "swapped", "A/A")
    ]
    for r in p3["dispatcher"]:
        assert _finite_pos(r["a_median_us"]) and _finite_pos(r["b_median_us"])
        assert math.isfinite(r["extra_ns"])
    assert "The class dispatcher's own cost" in md
    # P5: convert/revert times at 10, 100, 1000 layers; revert restored the stock classes
    p5 = cases["P5"]
    assert [r["layers"] for r in p5["rows"]] == [10, 100, 1000]
    for r in p5["rows"]:
        assert _finite_pos(r["convert_ms"]) and _finite_pos(r["revert_ms"])
    last = p5["rows"][-1]  # the verdict follows from the figures (goal: < 20 ms)
    assert last["verdict"] == (
        "met" if max(last["convert_ms"], last["revert_ms"]) < 20.0 else "missed"
    )
    # P6: memory measured in subprocesses: identical peaks (same kernels, same buffers)
    p6 = cases["P6"]["rows"][0]
    assert _finite_pos(p6["bnswap_peak_mib"]) and _finite_pos(p6["stock_peak_mib"])
    assert p6["ratio"] == pytest.approx(1.0, abs=0.01)


def test_median_ci_covers_the_median(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.harness import Comparison, median_ci

    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    xs = list(range(1, 11))
    lo, hi = median_ci([float(x) for x in xs])
    assert (lo, hi) == (2.0, 9.0)  # order statistics 2 and 9 of 10: >= 95 % coverage
    c = Comparison([2.0, 4.0, 6.0], [1.0, 2.0, 4.0], inner=1, warmup=0)
    assert c.ratios == [2.0, 2.0, 1.5] and c.ratio_median == 2.0


def test_p4_hook_skips_without_onnxruntime(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bnswap.ort
    from benchmarks.cases import Settings, p4_ort

    monkeypatch.setattr(bnswap.ort, "is_available", lambda: False)
    out = p4_ort(Settings(quick=True, log=lambda s: None))
    assert out["status"] == "skipped: ORT backend not installed" and out["rows"] == []
    assert "onnxruntime-training" in out["detail"]


@pytest.mark.ort
def test_p4_breakdown_splits_both_steps_by_kernel_family(monkeypatch):
    """P4's explanation: per-family kernel time of the ORT and eager steps of one net,
    and ORT's ReluGrad against ATen's threshold_backward on the same tensors."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bnswap.ort

    if not bnswap.ort.is_available():
        pytest.skip("onnxruntime-training / torch-ort not installed")
    import torch

    from benchmarks.cases import ort_breakdown, relu_grad_micro
    from benchmarks.report import to_markdown

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = ort_breakdown("convnet4", steps=1)
        m = relu_grad_micro(shape=(4, 8, 16, 16), reps=3)
    finally:
        torch.set_num_threads(threads)
    fams = {f["family"]: f for f in b["families"]}
    # every conv / BN / ReLU of ConvNet4 shows up on both sides, with real time
    for fam in ("conv", "conv backward", "batch norm", "activation", "activation backward"):
        assert fams[fam]["ort_ms"] > 0 and fams[fam]["aten_ms"] > 0, fam
    assert _finite_pos(m["ort_relugrad_ms"]) and _finite_pos(m["aten_threshold_backward_ms"])
    machine = {
        k: "x"
        for k in (
            "cpu",
            "logical_cpus",
            "memory_gib",
            "os",
            "python",
            "torch",
            "torch_threads",
            "load_average_start",
            "git_commit",
        )
    }
    res = {
        "schema": 1,
        "created": "now",
        "command": "test",
        "machine": machine,
        "config": {"quick": False},
        "cases": {
            "P4": {"status": "ok", "goal": "<= 1.00", "rows": [], "breakdown": [b], "relu_grad": m}
        },
    }
    md = to_markdown(res)
    assert "| batch norm |" in md and "ReluGrad" in md


def test_startup_benchmark_reports_each_command_and_what_it_imported(tmp_path):
    """benchmarks/startup.py (issue 21, item 1): one round, its report read back; the
    figures themselves are the benchmark's, not a test's."""
    stem = tmp_path / "startup"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "startup.py"),
            "--rounds",
            "1",
            "--commands",
            "import torch,bnswap --help,bnswap nope",
            "--out",
            str(stem),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(stem.with_suffix(".json").read_text())
    rows = report["commands"]
    assert list(rows) == ["import torch", "bnswap --help", "bnswap nope"]
    assert rows["import torch"]["imports"] == ["torch"]
    assert rows["bnswap --help"]["imports"] == rows["bnswap nope"]["imports"] == []
    assert rows["import torch"]["ratio_to_import_torch"] == 1.0
    for row in rows.values():
        assert len(row["samples_s"]) == 1 and row["median_s"] == row["min_s"] > 0
    assert "| `bnswap --help` |" in stem.with_suffix(".md").read_text()
