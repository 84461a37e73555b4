"""Synchronized BatchNorm (bnswap.sync) on real gloo processes, against ONE process running
stock ``nn.BatchNorm`` on the concatenation of every rank's batch (float64 within 1e-10,
float32 within float rounding): outputs, input gradients, the sum over ranks of the
parameter gradients, running statistics and num_batches_tracked, over several steps with
uneven and empty per-rank batches; 2 and 3 ranks. Every case of a world size runs in ONE
spawn (tests/sync_cases.py), so the suite starts 5 processes in all. Plus what needs no
process group: conversion and revert, the unsynchronized path, the ORT refusal."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import COLLECTIVE_TIMEOUT_S, rank_env, run_processes

sys.path.insert(0, str(Path(__file__).parent))
import sync_cases

SCRIPT = Path(sync_cases.__file__)


def _spawn(world: int, out: Path) -> list[dict]:
    env = rank_env(
        PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    proc = run_processes([sys.executable, str(SCRIPT), str(world), str(out)], timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request, tmp_path_factory):
    return request.param, _spawn(request.param, tmp_path_factory.mktemp(f"sync{request.param}"))


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float64:
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-10)
    else:
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-5)


def test_synchronized_layers_equal_stock_on_the_global_batch(ranks):
    world, results = ranks
    for case, kwargs, cls, steps, feature, dtype, channels_last in sync_cases.CASES[world]:
        ref = cls(**kwargs).double()
        sync_cases._init_params(ref, case)
        for i, sizes in enumerate(steps):
            xs, dys = sync_cases.batches(case, sizes, feature, dtype, i)
            x = torch.cat(xs).double().requires_grad_(True)
            for p in ref.parameters():
                p.grad = None
            out = ref(x)
            out.backward(torch.cat(dys).double())
            bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            for r in range(world):
                rec = results[r]["cases"][case]["records"][i]
                part = slice(bounds[r], bounds[r + 1])
                assert rec["out"].dtype == dtype
                _close(rec["out"], out[part].detach(), dtype)
                _close(rec["grad"], x.grad[part], dtype)
                if channels_last and sizes[r] > 0:
                    assert rec["cl"], (case, r)
                for k in ("running_mean", "running_var", "num_batches_tracked"):
                    mine, theirs = rec["state"][k], getattr(ref, k)
                    assert (mine is None) == (theirs is None), (case, k)
                    if mine is not None:
                        _close(mine, theirs, dtype)
            for j, p in enumerate(ref.parameters()):  # each rank's share adds up
                _close(
                    sum(results[r]["cases"][case]["records"][i]["pgrads"][j] for r in range(world)),
                    p.grad,
                    dtype,
                )


def test_eval_is_stock_bitwise_and_revert_gives_the_original_back(ranks):
    world, results = ranks
    for case, kwargs, cls, _, _, dtype, _ in sync_cases.CASES[world]:
        for r in range(world):
            res = results[r]["cases"][case]
            assert res["reverted"], case
            stock = cls(**kwargs).to(dtype)
            with torch.no_grad():
                for p, v in zip(stock.parameters(), res["final_params"], strict=True):
                    p.copy_(v)
                for k, v in res["final"].items():
                    if v is not None:
                        getattr(stock, k).copy_(v)
            stock.eval()
            assert torch.equal(res["eval"], stock(res["eval_input"])), (case, r)


def test_compiled_fullgraph_matches_eager_on_two_ranks(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("compiled on 2 ranks")
    for r in range(2):
        c = results[r]["compiled"]  # fullgraph=True: a graph break would have raised
        for step in ("out0", "out1"):
            torch.testing.assert_close(*c[step], rtol=0, atol=1e-12)
        for a, b in c["grads"] + c["state"]:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_cuda_slots_wired_as_torchs_cuda_kernels_compute(ranks):
    """Guards the wiring of the CUDA slots (issue 28; no GPU here): the cases of
    ``sync_cases.CUDA_SLOT_CASES`` run again with the CPU's slots replaced by the CUDA ones
    (``batch_norm_update_stats``, and references of ``batch_norm_backward_reduce`` /
    ``batch_norm_backward_elemt`` as their CUDA kernels compute) and give what the CPU run
    gave: outputs, input and parameter gradients, running statistics."""
    world, results = ranks
    if world != 2:
        pytest.skip("2 ranks")
    specs = {spec[0]: spec for spec in sync_cases.CASES[2]}
    for r in range(2):
        got = results[r]["cuda_slots"]
        assert got["calls"]["backward_reduce"] > 0 and got["calls"]["backward_elemt"] > 0
        assert sorted(got["cases"]) == sorted(sync_cases.CUDA_SLOT_CASES)
        for case, res in got["cases"].items():
            dtype = specs[case][5]
            for mine, theirs in zip(
                res["records"], results[r]["cases"][case]["records"], strict=True
            ):
                for k in ("out", "grad"):
                    _close(mine[k], theirs[k], dtype)
                for a, b in zip(mine["pgrads"], theirs["pgrads"], strict=True):
                    _close(a, b, dtype)
                for k, v in mine["state"].items():
                    if v is not None:
                        _close(v, theirs["state"][k], dtype)


def test_cpu_statistics_kernel_only_where_it_sums_accurately():
    """Guards the layout rule of the CPU statistics slot (issue 28): ATen's batch-norm
    statistics kernel runs for NCHW-contiguous input (a channel summed in double) and
    gives its statistics within float32's rounding of the float64 ones at a large mean
    (1e4, std 1, 262144 values a channel); channels-last and (N, C) input, whose kernel
    sums a float buffer row after row (the mean off by several std there), take the
    portable ops (the slot returns None)."""
    from bnswap import sync

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(256, 4, 32, 32, generator=g, dtype=torch.float64) + 1e4
    x = x64.float()
    stats = sync.DEVICE_KERNELS["cpu"].stats
    cases = {
        "nchw": x,
        "channels_last": x.to(memory_format=torch.channels_last),
        "(N, C)": x.permute(0, 2, 3, 1).reshape(-1, 4),
    }
    used = {}
    for name, t in cases.items():
        got = stats(t)
        used[name] = got is not None
        if got is None:
            continue
        ref = t.double()
        dims = [0, *range(2, t.dim())]
        mean, var = ref.mean(dims), ref.var(dims, unbiased=False)
        assert ((got[0].double() - mean).abs() / var.sqrt()).max() < 2e-3, name
        assert ((got[1].double() - var).abs() / var).max() < 1e-5, name
    assert used == {"nchw": True, "channels_last": False, "(N, C)": False}


def test_errors_on_many_ranks(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("2 ranks")
    for r in range(2):
        e = results[r]["errors"]
        # one value per channel in the global batch (1 + 0): stock's ValueError on every
        # rank, nothing changed
        assert e["one_value"].startswith(
            "Expected more than 1 value per channel when training, got input size "
            f"torch.Size([{1 - r}, 3])"
        ), e["one_value"]
        assert e["one_value_state_same"]
        assert (
            e["momentum"]
            == ("batch_norm(): argument 'momentum' (position 7) must be float, not str")
            and e["momentum_state_same"]
        )
        shape, state = e["all_empty"]  # an all-empty global batch: stock's early return
        assert shape == (0, 3) and int(state["num_batches_tracked"]) == 1
        assert torch.equal(state["running_mean"], torch.zeros(3))
        assert torch.equal(state["running_var"], torch.ones(3))
        # a layer without num_batches_tracked (issue 46): stock's AttributeError in
        # training with tracking, before any collective or state change; runs otherwise
        assert e["no_counter"] == {
            True: "'SyncBatchNorm' object has no attribute 'num_batches_tracked'; state same: True",
            False: True,
            "eval": True,
        }
    assert results[0]["errors"]["not_member"] is None  # a group of one rank: unsynchronized
    assert "is not in the layer's process_group" in results[1]["errors"]["not_member"]
    assert results[0]["errors"]["plan_sync"] == ["group of 1 rank", "WORLD, 2 ranks"]
    assert results[1]["errors"]["plan_sync"] == ["group without this rank", "WORLD, 2 ranks"]
    assert results[0]["errors"]["ddp_stock"].startswith(  # torch's, then the layers (issue 26)
        "SyncBatchNorm layers only work with GPU modules: 1 torch.nn.SyncBatchNorm layer is "
        "not swapped by bnswap ('1'). On the CPU only bnswap's swapped SyncBatchNorm runs."
    )


def test_bad_input_on_one_rank_leaves_no_rank_waiting(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("2 ranks")
    bad, good = results[1]["bad_input"], results[0]["bad_input"]
    # stock's error on the bad rank, before any collective and before any state change
    assert bad == {"error": "RuntimeError: running_mean should contain 4 elements not 3", "nbt": 0}
    # the good rank's collective ended with an error when the bad rank left (both exited:
    # the spawn returned), and it changed nothing either
    assert good["error"] is not None and good["nbt"] == 0


def test_convert_sync_batchnorm_shares_state_and_reverts_to_the_original_objects():
    bn1, bn2 = nn.BatchNorm1d(4), nn.BatchNorm2d(3, momentum=None)
    model = nn.Sequential(nn.Linear(2, 4), bn1, nn.Unflatten(1, (4, 1, 1)), nn.Conv2d(4, 3, 1), bn2)
    hook_calls = []
    bn2.register_forward_hook(lambda m, i, o: hook_calls.append(type(m).__name__))
    bn2.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params, buffers = list(model.parameters()), list(model.buffers())
    out = bnswap.convert(model, sync_batchnorm=True)
    assert out is model
    assert [type(m) for m in model if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        nn.SyncBatchNorm,
        nn.SyncBatchNorm,
    ]
    assert all(bnswap.is_swapped(model[i]) for i in (1, 4))
    assert list(model.parameters()) == params and list(model.buffers()) == buffers
    assert not model[4].training and model[1].training and model[4].momentum is None
    p = bnswap.plan(model)
    # (what the plan says: WORLD once a process group exists, unsynchronized until then)
    assert [r.sync for r in p] == ["WORLD after init_process_group; unsynchronized before"] * 2
    # no process group: the unsynchronized path, as stock BatchNorm on a copy
    twin = copy.deepcopy(bnswap.revert(copy.deepcopy(model)))
    x = torch.randn(5, 2)
    model(x).sum().backward()
    opt.step()  # the optimizer built before still moves the layers' parameters
    twin(x).sum().backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert hook_calls == ["SyncBatchNorm", "BatchNorm2d"]  # (the twin's copy of the hook)
    model.train()
    assert bnswap.revert(model) is model
    assert model[1] is bn1 and model[4] is bn2 and type(bn2) is nn.BatchNorm2d
    assert bn2.training and not bnswap.is_swapped(bn2)
    assert list(model.parameters()) == params and list(model.buffers()) == buffers
    model(x)
    assert hook_calls[2:] == ["BatchNorm2d"]  # its own hooks
    # a layer as the model: convert returns the SyncBatchNorm, revert the layer
    sync = bnswap.convert(bn1, sync_batchnorm=True)
    assert type(sync) is nn.SyncBatchNorm and sync.weight is bn1.weight
    assert bnswap.revert(sync) is bn1


def test_revert_keeps_flags_set_on_the_syncbatchnorm():
    """momentum / eps / track_running_stats set while the SyncBatchNorm stood in (a
    momentum schedule, say) are the original layer's after revert (they are plain
    attributes, copied by value at convert): the reverted layer then trains as a stock
    layer given the same settings, bitwise."""
    bn = nn.BatchNorm2d(3)
    stock = copy.deepcopy(bn)
    model = bnswap.convert(nn.Sequential(bn), sync_batchnorm=True)
    model[0].momentum, model[0].eps = None, 1e-3
    model.eval()
    assert bnswap.revert(model)[0] is bn
    assert (bn.momentum, bn.eps, bn.training) == (None, 1e-3, False)
    stock.momentum, stock.eps = None, 1e-3
    bn.train(), stock.train()
    for _ in range(2):
        x = torch.randn(4, 3, 2, 2)
        assert torch.equal(bn(x), stock(x))
    assert torch.equal(bn.running_var, stock.running_var)
    assert torch.equal(bn.num_batches_tracked, stock.num_batches_tracked)


def test_plan_rows_say_what_synchronizes():
    class Custom(nn.BatchNorm2d):
        pass

    model = nn.Sequential(nn.BatchNorm2d(2), Custom(2), nn.LazyBatchNorm1d(), nn.SyncBatchNorm(2))
    rows = bnswap.plan(model, sync_batchnorm=True, exclude="3")
    assert [(r.action, r.sync_class, r.sync) for r in rows] == [
        ("swap", nn.SyncBatchNorm, "WORLD after init_process_group; unsynchronized before"),
        ("swap", None, "-"),
        ("swap", None, "-"),
        ("skip", None, "-"),
    ]
    assert "not synchronized" in rows[1].reason and "becomes SyncBatchNorm" in rows[0].reason
    assert "sync" in str(rows).splitlines()[1]  # the sync column
    assert "sync" not in str(bnswap.plan(nn.BatchNorm2d(2))).splitlines()[1]
    assert not bnswap.is_swapped(model[0])  # a plan changes nothing


def test_stock_syncbatchnorm_without_process_group_is_stock_bitwise():
    layer, stock = nn.SyncBatchNorm(3, momentum=None), nn.BatchNorm2d(3, momentum=None)
    bnswap.convert(layer)
    for _ in range(2):
        x = torch.randn(4, 3, 2, 2)
        assert torch.equal(layer(x), stock(x))
    assert torch.equal(layer.running_var, stock.running_var)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        layer(torch.randn(3))


def test_ort_backend_refuses_syncbatchnorm():
    from bnswap.ort.errors import UnsupportedLayerError

    model = nn.Sequential(nn.BatchNorm2d(2), nn.SyncBatchNorm(2))
    with pytest.raises(UnsupportedLayerError, match="'1' is a SyncBatchNorm; the ONNX Runtime"):
        bnswap.convert(model, backend="ort")
    with pytest.raises(UnsupportedLayerError, match="sync_batchnorm=True with backend='ort'"):
        bnswap.convert(nn.Sequential(nn.BatchNorm2d(2)), backend="ort", sync_batchnorm=True)
    assert not bnswap.is_swapped(model[0])  # refused before anything changed


@pytest.mark.zoo
def test_timm_batchnormact2d_becomes_timms_syncbatchnormact():
    """timm's BatchNormAct2d gets timm's own synchronized class (what
    timm.layers.convert_sync_batchnorm makes), with drop and act kept; without a process
    group it runs as the stock layer, bitwise; revert gives the original back."""
    timm = pytest.importorskip("timm")
    from timm.layers.norm_act import SyncBatchNormAct

    layer = timm.layers.BatchNormAct2d(4, act_layer=nn.ReLU)
    stock = copy.deepcopy(layer)
    model = nn.Sequential(layer)
    row = bnswap.plan(model, sync_batchnorm=True)[0]
    assert row.sync_class is SyncBatchNormAct and "timm's SyncBatchNormAct" in row.reason
    bnswap.convert(model, sync_batchnorm=True)
    sync = model[0]
    assert type(sync) is SyncBatchNormAct and sync.act is layer.act
    assert bnswap.plan(model)[0].adapter_name == "bnswap.adapters.timm.sync_batch_norm_act_2d"
    x = torch.randn(3, 4, 5, 5)
    assert torch.equal(model(x), stock(x)) and torch.equal(sync.running_var, stock.running_var)
    assert (model(x) >= 0).all()  # its act still applies
    assert bnswap.revert(model)[0] is layer and type(layer) is timm.layers.BatchNormAct2d


EXAMPLE = SCRIPT.parents[1] / "examples" / "ddp_syncbn.py"


def _torchrun_example(
    *args: str, timeout: float = 400, path: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 examples/ddp_syncbn.py *args`` on 127.0.0.1, one
    thread a rank, ``path`` put first on PYTHONPATH."""
    root = SCRIPT.parents[1]
    env = rank_env(PYTHONPATH=os.pathsep.join([*path, str(root), os.environ.get("PYTHONPATH", "")]))
    return run_processes(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={sync_cases.free_port()}",
            str(EXAMPLE),
            *args,
        ],
        timeout=timeout,
        env=env,
        cwd=root,
    )


def test_ddp_syncbn_example_without_scikit_learn_says_so_in_one_line(tmp_path):
    """Guards (a user's try): without scikit-learn every rank printed a traceback from
    inside the data loading, after the process group had started. Now each rank prints
    one line naming what to install (torchrun stops the other rank when the first exits,
    so at least one line) and exits 1 before init_process_group; no frame of the example
    is printed (torchrun's own ChildFailedError report follows)."""
    fake = tmp_path / "sklearn"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n"
    )
    proc = _torchrun_example(
        "--steps=1", f"--timeout_s={COLLECTIVE_TIMEOUT_S}", timeout=120, path=(str(tmp_path),)
    )
    line = (
        "examples/ddp_syncbn.py: needs scikit-learn for the digits data: pip install scikit-learn"
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stderr.count(line) in (1, 2), proc.stderr[-4000:]
    assert f'File "{EXAMPLE}"' not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    assert "sklearn" not in proc.stderr.replace(line, ""), proc.stderr[-4000:]
    assert "exitcode  : 1" in proc.stderr  # (torchrun's report: a rank exited 1)
    assert proc.stdout == ""  # no plan printed: no process group started


def test_ddp_syncbn_example_refuses_a_bad_batch_or_step_count_before_any_process_group():
    """``batch_size`` < 2 (a training BatchNorm needs more than one value per channel) and
    ``steps`` < 1 raise ValueError in ``main`` before torch.distributed is touched."""
    import importlib.util

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("ddp_syncbn", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(ValueError, match=r"batch_size must be at least 2.*got 1"):
        mod.main(batch_size=1)
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        mod.main(steps=0)
    assert not dist.is_initialized()


def test_ddp_syncbn_example_under_torchrun_matches_one_process(tmp_path):
    """examples/ddp_syncbn.py with ``torchrun --nproc_per_node=2`` (gloo, CPU): convert with
    sync_batchnorm=True, DDP, train, revert. Both ranks end with the same state, equal to
    ONE process training stock BatchNorm2d on the concatenated global batches (its mean
    loss, the example's falling learning rate), with a global batch of 33 split 17 / 16:
    guards the example's uneven split (each rank's loss its share of the global mean),
    and that DDP runs without a FutureWarning (torch 2.13 deprecates broadcast_buffers)."""
    import importlib.util

    steps, batch, lr = 3, 33, 0.05
    proc = _torchrun_example(
        f"--steps={steps}",
        f"--batch_size={batch}",
        f"--lr={lr}",
        f"--out={tmp_path}",
        "--float64=true",
        f"--timeout_s={COLLECTIVE_TIMEOUT_S}",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "synchronized over: WORLD, 2 ranks | kernel: Sync (Native); eval Native" in proc.stdout
    assert "stock BatchNorm2d layers again" in proc.stdout
    assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]
    s0, s1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []  # no buffer broadcast
    spec = importlib.util.spec_from_file_location("ddp_syncbn", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (xt, yt), _ = mod.digits_split(16, seed=0)
    ref = mod.build(0.5, 0).double()  # stock BatchNorm2d, one process, the global batch
    opt, schedule = mod.optimizer(ref, lr, steps)
    for idx in mod.global_batches(len(yt), batch, steps, 0):
        loss = torch.nn.functional.cross_entropy(ref(xt[idx].double()), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    theirs = ref.state_dict()
    assert s0.keys() == theirs.keys()
    for k in s0:
        # (float64; the net amplifies rounding to ~1e-8 in 3 steps, for stock as well)
        torch.testing.assert_close(s0[k], theirs[k], rtol=1e-7, atol=1e-7)
    moved = [k for k in s0 if "running_var" in k and not torch.equal(s0[k], torch.ones_like(s0[k]))]
    assert len(moved) == len([k for k in s0 if "running_var" in k])  # statistics trained
