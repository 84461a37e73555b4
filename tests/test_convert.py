"""convert / revert / plan keep everything a user attached to the model."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

import bnswap
from bnswap._swap import SWAP


def net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8, momentum=None)),
        nn.Flatten(),
        nn.LazyLinear(4),
        nn.BatchNorm1d(4, affine=False),
    )


def bns(model):
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def test_import_does_not_import_lightning_or_onnxruntime():
    code = (
        "import sys, bnswap; bad=[m for m in sys.modules if m.split('.')[0] in "
        "('lightning','pytorch_lightning','onnxruntime','torch_ort','timm')]; print(bad)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_convert_swaps_in_place_sharing_parameters_and_buffers():
    model = net()
    model(torch.randn(2, 3, 6, 6))
    before = [
        (
            id(m),
            [id(t) for t in m.parameters(recurse=False)],
            [id(t) for t in m.buffers(recurse=False)],
        )
        for m in bns(model)
    ]
    out = bnswap.convert(model)
    assert out is model
    after = [
        (
            id(m),
            [id(t) for t in m.parameters(recurse=False)],
            [id(t) for t in m.buffers(recurse=False)],
        )
        for m in bns(model)
    ]
    assert before == after
    # the classes stay torch's: only each layer's forward is bnswap's
    assert [type(m) for m in bns(model)] == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]
    assert [isinstance(m, (bnswap.BatchNorm2d, bnswap.BatchNorm1d)) for m in bns(model)] == [
        True,
        True,
        True,
    ]
    for m in bns(model):  # isinstance checks of Lightning, timm, swa_utils keep working
        assert isinstance(m, _BatchNorm) and bnswap.is_swapped(m)


def test_optimizer_built_before_the_swap_keeps_working():
    torch.manual_seed(0)
    a = net()
    a(torch.randn(2, 3, 6, 6))
    b = copy.deepcopy(a)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    bnswap.convert(b)  # after the optimizer exists
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6)
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for (k, v), (k2, v2) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k


def test_keeps_flags_hooks_qconfig_and_state_dict_keys():
    model = net()
    model(torch.randn(2, 3, 6, 6))
    keys = list(model.state_dict().keys())
    bn = model[1]
    bn.eval()  # a submodule in eval stays in eval
    bn.weight.requires_grad_(False)
    bn.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    calls = []
    bn.register_forward_hook(lambda m, i, o: calls.append("fwd"))
    bn.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    # register_state_dict_post_hook: torch >= 2.5; torch 2.4 has it as a private method
    register = getattr(bn, "register_state_dict_post_hook", None) or bn._register_state_dict_hook
    register(lambda m, sd, prefix, local: calls.append("sd"))
    bnswap.convert(model)
    assert type(bn) is nn.BatchNorm2d and bnswap.is_swapped(bn)
    assert not bn.training and model.training and model[3][1].training
    assert not bn.weight.requires_grad
    assert bn.qconfig is not None
    model(torch.randn(2, 3, 6, 6))
    model.state_dict()
    assert calls == ["pre", "fwd", "sd"]
    assert list(model.state_dict().keys()) == keys
    # inspecting gives what stock gives: the repr (and print(model)) are torch's
    assert repr(bn) == repr(nn.BatchNorm2d(8))


class _Scale(nn.Module):
    def forward(self, w):
        return 2.0 * w


def test_parametrizations_are_kept_and_revert_restores_them():
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    parametrize.register_parametrization(stock[1], "weight", _Scale())
    model = copy.deepcopy(stock)
    bnswap.convert(model)
    bn = model[1]
    assert isinstance(bn, bnswap.BatchNorm2d) and parametrize.is_parametrized(bn, "weight")
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(stock(x), model(x))
    cls = type(model[1])
    bnswap.revert(model)
    assert type(model[1]) is cls and not bnswap.is_swapped(model[1])  # the same class
    parametrize.remove_parametrizations(model[1], "weight")
    assert type(model[1]) is nn.BatchNorm2d


def test_convert_is_idempotent():
    model = net()
    bnswap.convert(model)
    classes = [type(m) for m in model.modules()]
    bnswap.convert(model)
    assert [type(m) for m in model.modules()] == classes
    rows = bnswap.plan(model)
    assert all(r.action == "keep" for r in rows)  # (issue 26: was "swap")
    assert {r.reason for r in rows} >= {"already swapped"}
    assert rows.summary() == (
        "bnswap plan: all 3 BatchNorm layers already swapped: nothing would change"
    )
    assert repr(rows) == "Plan(0 swap, 3 keep, 0 skip)"


def test_plan_of_a_converted_model_says_keep_and_apply_changes_only_what_is_new():
    """Issue 26: the plan of an already converted model said ``swap`` ("already
    swapped"), as if something would change. Its rows say ``keep``; a layer added since
    says ``swap``; apply and convert swap only that one, keeping the others' forwards."""
    model = net()
    bnswap.convert(model)
    forwards = [vars(m)[SWAP] for m in bns(model)]
    model.add_module("extra", nn.BatchNorm1d(4))
    p = bnswap.plan(model)
    assert [(r.action, r.reason, r.already) for r in p] == [
        ("keep", "already swapped", True)
    ] * 3 + [("swap", "-", False)]
    assert [d["action"] for d in p.to_dicts()] == ["keep", "keep", "keep", "swap"]
    assert [r.backend for r in p] == ["aten"] * 4 and len(p.swapped) == 4 and len(p.kept) == 3
    assert p.summary() == (
        "bnswap plan: 1 of 4 BatchNorm layers would be swapped, 3 already swapped, 0 skipped"
    )
    assert str(p).splitlines()[3].split()[2] == "keep"
    assert p.apply() is model
    assert p.summary() == "bnswap: 1 of 4 BatchNorm layers swapped, 3 already swapped, 0 skipped"
    assert [vars(m)[SWAP] for m in bns(model)][:3] == forwards
    assert bnswap.is_swapped(model.extra)
    assert [r.action for r in bnswap.plan(model)] == ["keep"] * 4
    assert bnswap.convert(model) is model  # nothing to do, nothing said
    assert [vars(m)[SWAP] for m in bns(model)][:3] == forwards


def test_root_batchnorm_is_converted():
    bn = nn.BatchNorm2d(3)
    out = bnswap.convert(bn)
    assert out is bn and type(bn) is nn.BatchNorm2d and bnswap.is_swapped(bn)
    assert bnswap.plan(bn)[0].name == "(root)"


def test_revert_is_the_exact_inverse():
    model = net()
    model(torch.randn(2, 3, 6, 6))
    ref_types = [type(m) for m in model.modules()]
    ids = [id(t) for t in model.state_dict(keep_vars=True).values()]
    bnswap.revert(bnswap.convert(model))
    assert [type(m) for m in model.modules()] == ref_types
    assert [id(t) for t in model.state_dict(keep_vars=True).values()] == ids


@pytest.mark.parametrize(
    "include,exclude,expect",
    [
        (None, None, ["1", "3.1", "6"]),
        ("3.*", None, ["3.1"]),
        (None, "3.*", ["1", "6"]),
        (nn.BatchNorm1d, None, ["6"]),
        (None, [nn.BatchNorm1d, "1"], ["3.1"]),
        (["1", "6"], "6", ["1"]),
    ],
)
def test_include_exclude(include, exclude, expect):
    model = net()
    bnswap.convert(model, include=include, exclude=exclude)
    got = [n for n, m in model.named_modules() if bnswap.is_swapped(m)]
    assert got == expect
    skipped = {r.name: r.reason for r in bnswap.plan(model) if r.action == "skip"}
    for _name, reason in skipped.items():
        assert reason.startswith(("excluded by", "not matched by include")), reason


def test_pattern_matching_nothing_warns():
    with pytest.warns(UserWarning, match="include pattern 'backbone.\\*' matches no BatchNorm"):
        bnswap.plan(net(), include="backbone.*")


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"expects a torch.nn.Module"):
        bnswap.convert({"not": "a module"})
    with pytest.raises(ValueError, match="unknown backend 'cudnn'; choose one of 'aten', 'ort'"):
        bnswap.convert(net(), backend="cudnn")
    with pytest.raises(TypeError, match="glob patterns"):
        bnswap.convert(net(), include=[3])


def test_syncbatchnorm_is_swapped_onto_the_synchronized_forward():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    p = bnswap.plan(model)
    assert p[0].action == "swap" and p[0].adapter_name == "bnswap.sync.sync_batch_norm_forward"
    bnswap.convert(model)
    assert type(model[1]) is nn.SyncBatchNorm and bnswap.is_swapped(model[1])


def test_lazy_batchnorm_becomes_bnswap_on_initialization():
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())
    model[0].load_state_dict(stock[0].state_dict())  # lazy modules cannot be deep-copied
    p = bnswap.plan(model)
    assert p[0].action == "swap" and "when it initializes" in p[0].reason
    bnswap.convert(model)
    assert bnswap.is_swapped(model[1])
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(stock(x), model(x))
    assert type(model[1]) is type(stock[1]) is nn.BatchNorm2d and bnswap.is_swapped(model[1])
    assert torch.equal(stock[1].running_var, model[1].running_var)
    # revert before initialization: becomes stock again
    lazy = bnswap.convert(nn.Sequential(nn.LazyBatchNorm1d()))
    bnswap.revert(lazy)
    lazy(torch.randn(3, 2))
    assert type(lazy[0]) is nn.BatchNorm1d and not bnswap.is_swapped(lazy[0])


def test_plan_table_and_logging(caplog):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.SyncBatchNorm(4))
    p = bnswap.plan(model)
    text = str(p)
    lines = text.splitlines()
    assert lines[0] == "bnswap plan: 2 of 2 BatchNorm layers would be swapped, 0 skipped"
    header, _rule, row1, row2 = lines[1:]
    for col in ("layer", "class", "action", "backend", "kernel", "adapter", "sync", "reason"):
        assert col in header
    # aligned: every column starts at the same offset in header, rule and rows
    starts = [header.index(c) for c in ("class", "action", "backend", "kernel")]
    for line in (row1, row2):
        for s in starts:
            assert line[s - 2 : s] == "  " and line[s] != " "
    assert row1.split()[:5] == ["1", "BatchNorm2d", "swap", "aten", "Native"]
    assert p[0].adapter_name == "bnswap.layers.batch_norm_forward" and p[0].kernel == "Native"
    # (the kernel for another device: tests/test_kernel_selection.py)
    assert text == (
        "bnswap plan: 2 of 2 BatchNorm layers would be swapped, 0 skipped\n"
        "layer  class          action  backend  kernel  adapter                              "
        "sync                                                   reason\n"
        "-----  -------------  ------  -------  ------  -----------------------------------  "
        "-----------------------------------------------------  ------\n"
        "1      BatchNorm2d    swap    aten     Native  bnswap.layers.batch_norm_forward     "
        "-                                                      -\n"
        "2      SyncBatchNorm  swap    aten     Native  bnswap.sync.sync_batch_norm_forward  "
        "WORLD after init_process_group; unsynchronized before  -"
    )
    assert str(bnswap.plan(nn.Sequential(nn.Linear(2, 2)))) == (
        "bnswap plan: 0 of 0 BatchNorm layers would be swapped, 0 skipped "
        "(the model has no BatchNorm layers)"
    )
    caplog.set_level(logging.INFO, logger="bnswap")
    bnswap.convert(model)
    # convert logs the applied plan: what was done, not what would be
    done = "bnswap: 2 of 2 BatchNorm layers swapped, 0 skipped\n" + text.partition("\n")[2]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("bnswap")] == [done]


def test_a_dry_plan_says_would_be_swapped_and_the_applied_one_swapped():
    """Guards (issue 33, a newcomer's report): ``print(bnswap.plan(model))`` said "1 of 1
    BatchNorm layers swapped" before anything was swapped. A plan says what would happen
    until its ``apply`` succeeds, then what was done; a failed apply leaves it dry."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    p = bnswap.plan(model)
    assert not p.applied and not bnswap.is_swapped(model[1])
    assert p.summary() == "bnswap plan: 1 of 1 BatchNorm layers would be swapped, 0 skipped"
    assert str(p).splitlines()[0] == p.summary()
    assert p.apply() is model and p.applied and bnswap.is_swapped(model[1])
    assert p.summary() == "bnswap: 1 of 1 BatchNorm layers swapped, 0 skipped"
    assert str(p).splitlines()[0] == p.summary()
    again = bnswap.plan(model)  # planned after the swap: the layer is kept, nothing to do
    assert again.summary() == (
        "bnswap plan: 1 of 1 BatchNorm layers already swapped, 0 skipped: nothing would change"
    )
    again.apply()
    assert again.summary() == (
        "bnswap: 1 of 1 BatchNorm layers already swapped, 0 skipped: nothing changed"
    )
    # an apply that fails (ORT refuses a skipped layer) leaves the plan dry
    refused = bnswap.plan(nn.Sequential(nn.BatchNorm2d(2), nn.BatchNorm2d(2)), "ort", exclude="1")
    with pytest.raises(TypeError):
        refused.apply()
    assert not refused.applied and refused.summary().startswith(
        "bnswap plan: 1 of 2 BatchNorm layers would be swapped, 1 skipped; "
    )
    # a program's plan too
    ep = torch.export.export(nn.Sequential(nn.BatchNorm1d(4)), (torch.randn(2, 4),))
    pp = bnswap.plan(ep)
    assert pp.summary() == "bnswap plan: 1 of 1 batch-norm nodes would be swapped, 0 skipped"
    pp.apply()
    assert pp.summary() == "bnswap: 1 of 1 batch-norm nodes swapped, 0 skipped"


@pytest.mark.parametrize(
    "env, level",
    [
        ({}, logging.INFO),  # one process
        ({"RANK": "0"}, logging.INFO),  # torchrun's rank zero
        ({"RANK": "1"}, logging.DEBUG),
        ({"LOCAL_RANK": "1"}, logging.DEBUG),  # what Lightning's ddp launcher sets in rank 1
        ({"RANK": "0", "LOCAL_RANK": "1"}, logging.INFO),  # RANK first: the global rank
    ],
)
def test_the_plan_is_logged_at_info_on_rank_zero_only(caplog, monkeypatch, env, level):
    """Issue 26: a torchrun job logged the plan once per rank. Rank zero (or a single
    process) logs it at INFO, the other ranks at DEBUG (the process group's rank when one
    is initialized: tests/test_launchers.py runs that under torchrun)."""
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    caplog.set_level(logging.DEBUG, logger="bnswap")
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    p = bnswap.plan(model)
    p.apply()  # (convert logs its plan applied)
    text = str(p)
    bnswap.revert(model)
    bnswap.convert(model)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bnswap"] == [
        (level, text)
    ]


def test_a_layer_without_tensors_is_planned_for_the_cpu():
    """affine=False, track_running_stats=False: no parameter or buffer says the device."""
    p = bnswap.plan(nn.Sequential(nn.BatchNorm2d(3, affine=False, track_running_stats=False)))
    assert p[0].action == "swap" and p[0].kernel == "Native"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(include=[3]),
            "include takes glob patterns (str) on qualified module names and/or classes, got 3",
        ),
        (
            dict(exclude=[nn.BatchNorm2d, None]),
            "exclude takes glob patterns (str) on qualified module names and/or classes, got None",
        ),
        (  # not iterable (issue 46: list()'s "'int' object is not iterable")
            dict(exclude=42),
            "exclude takes glob patterns (str) on qualified module names and/or classes, got 42",
        ),
        (
            dict(include=3.5),
            "include takes glob patterns (str) on qualified module names and/or classes, got 3.5",
        ),
        (  # one pattern, not the ints list() makes of bytes ("got 49")
            dict(exclude=b"1"),
            "exclude takes glob patterns (str) on qualified module names and/or classes, got b'1'",
        ),
    ],
)
def test_bad_patterns_name_the_argument_and_the_item(kwargs, message):
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        bnswap.check_patterns(**kwargs)
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        bnswap.plan(net(), **kwargs)
    model = net()
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        bnswap.convert(model, **kwargs)
    assert not any(bnswap.is_swapped(m) for m in model.modules())  # before anything
    bnswap.check_patterns(include="a.*", exclude=(nn.BatchNorm1d, "b"))  # accepted


@pytest.mark.parametrize("empty", [[], (), set()], ids=["list", "tuple", "set"])
def test_an_empty_include_includes_nothing_and_says_so(empty):
    """Issue 46: include=[] swapped every layer (an empty list read as no include). An
    include is the list of layers to swap: empty, it swaps none, and a warning says so
    (None, the default, swaps every layer); an empty exclude excludes nothing."""
    from bnswap.plan import UnmatchedPatternWarning

    model = net()
    with pytest.warns(UnmatchedPatternWarning) as caught:
        assert bnswap.convert(model, include=empty) is model
    assert [str(w.message) for w in caught] == [
        "bnswap: include is empty, so it matches no BatchNorm layer and none is swapped "
        "(include=None, the default, swaps every layer)"
    ]
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    with pytest.warns(UnmatchedPatternWarning):
        rows = bnswap.plan(model, include=empty).rows
    assert {(r.action, r.reason, r.excluded) for r in rows} == {
        ("skip", "not matched by include", True)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bnswap.convert(model, exclude=empty)  # excludes nothing, says nothing
    assert all(bnswap.is_swapped(m) for m in bns(model))


def test_plan_does_not_change_the_model():
    model = net()
    ref = [type(m) for m in model.modules()]
    bnswap.plan(model, backend="ort")
    assert [type(m) for m in model.modules()] == ref


def test_revert_keeps_training_flags_and_hooks_of_a_mixed_mode_model():
    """Guards: every other revert test used an all-train model, or called .eval() before
    comparing, so a revert that reset ``training`` went unseen."""
    model = net()
    model(torch.randn(2, 3, 6, 6))
    model[1].eval()  # a frozen layer inside a training model
    model[3].eval()  # a frozen block (its BatchNorm too)
    model[6].train()
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append("hook"))
    flags = [(n, m.training) for n, m in model.named_modules()]
    hooks = [
        (n, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()
    ]
    ref = copy.deepcopy(model)
    bnswap.revert(bnswap.convert(model))
    assert [(n, m.training) for n, m in model.named_modules()] == flags
    assert [
        (n, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()
    ] == hooks
    x = torch.randn(4, 3, 6, 6)
    assert torch.equal(model(x), ref(x)) and calls == ["hook", "hook"]
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.parametrize(
    "device, error, message",
    [
        (
            "gpu",
            RuntimeError,
            "bnswap.plan: device 'gpu' is not a device type torch knows (a GPU, NVIDIA's or "
            "AMD's, is 'cuda'); torch's are cpu, cuda, ",
        ),
        ("tpu:0", RuntimeError, "bnswap.plan: device 'tpu' is not a device type torch knows; "),
        ("cuda:x", RuntimeError, "bnswap.plan: device 'cuda:x' is not one torch reads ("),
        (2.5, TypeError, "bnswap.plan: device is a torch.device, a str such as 'cuda' or "),
    ],
)
def test_an_unknown_device_fails_when_planned_with_bnswaps_error(device, error, message):
    """Issue 46: plan(m, device="gpu") gave torch's raw error. bnswap's names torch's device
    types (read from torch's own error: every type this torch knows) and, for a GPU's
    name, 'cuda'; torch's exception type. Modules and programs alike, before planning."""
    ep = torch.export.export(nn.Sequential(nn.BatchNorm2d(3)).eval(), (torch.randn(2, 3, 2, 2),))
    for target in (net(), ep):
        with pytest.raises(error) as caught:
            bnswap.plan(target, device=device)
        assert str(caught.value).startswith(message), str(caught.value)
        # (torch's own error is not chained under it: one message)
        assert caught.value.__cause__ is None
        assert caught.value.__context__ is None or caught.value.__suppress_context__
    assert bnswap.plan(net(), device="cuda:1")[0].kernel.startswith("Cudnn")  # (predicted)
    with pytest.raises(RuntimeError) as torchs:
        torch.device("gpu")
    types = str(torchs.value).removeprefix("Expected one of ").partition(" device type")[0]
    with pytest.raises(RuntimeError, match=re.escape(f"torch's are {types}, with an optional")):
        bnswap.plan(net(), device="gpu")


def test_plan_rows_as_dicts_and_the_swapped_forwards_repr():
    """Guards the keys of ``PlanRow.to_dict`` (what ``bnswap plan --format json`` and the
    log carry) and what a swapped layer's forward shows when printed."""
    model = nn.Sequential(nn.BatchNorm2d(2), nn.SyncBatchNorm(2), nn.BatchNorm2d(2))
    swapped, sync, skipped = bnswap.plan(model, exclude="2").to_dicts()
    assert swapped == {
        "name": "0",
        "cls": "BatchNorm2d",
        "action": "swap",
        "reason": "-",
        "backend": "aten",
        "kernel": "Native",
        "adapter": "bnswap.layers.batch_norm_forward",
        "sync": "-",
    }
    assert sync == {
        "name": "1",
        "cls": "SyncBatchNorm",
        "action": "swap",
        "reason": "-",
        "backend": "aten",
        "kernel": "Native",
        "adapter": "bnswap.sync.sync_batch_norm_forward",
        "sync": "WORLD after init_process_group; unsynchronized before",
    }
    assert skipped == {
        "name": "2",
        "cls": "BatchNorm2d",
        "action": "skip",
        "reason": "excluded by '2'",
        "backend": "-",
        "kernel": "-",
        "adapter": "-",
        "sync": "-",
    }
    bnswap.convert(model)
    assert repr(vars(model[0])[SWAP]) == "<bnswap swap: _BatchNorm.forward -> batch_norm_forward>"


def test_the_forward_of_a_layer_swapped_with_a_callable_object_names_it():
    """An adapter without ``__qualname__`` (a ``functools.partial``, a callable object) is
    shown by its repr; the layer runs it."""
    import functools

    from bnswap._swap import swap
    from bnswap.layers import batch_norm_forward

    stock, bn = nn.BatchNorm2d(2), nn.BatchNorm2d(2)
    adapter = functools.partial(batch_norm_forward)
    swap(bn, adapter)
    assert repr(vars(bn)[SWAP]) == f"<bnswap swap: _BatchNorm.forward -> {adapter!r}>"
    x = torch.randn(3, 2, 2, 2)
    assert torch.equal(bn(x), stock(x)) and torch.equal(bn.running_var, stock.running_var)


def _warnings_of(fn, *args, **kwargs) -> list[tuple[type, str, bool]]:
    """(category, message, whether it points at the line that called ``fn``) per warning.
    Under mutmut (MUTANT_UNDER_TEST set) the first frame outside bnswap is mutmut's
    trampoline, which calls every mutated function: that place counts as the caller's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fn(*args, **kwargs)
    trampoline = "MUTANT_UNDER_TEST" in os.environ and os.path.join(
        "mutmut", "mutation", "trampoline.py"
    )
    return [
        (
            w.category,
            str(w.message),
            (w.filename, w.lineno) == (__file__, line)
            or bool(trampoline and w.filename.endswith(trampoline)),
        )
        for w in caught
    ]


def test_convert_warnings_say_exactly_what_happened_at_the_callers_line():
    """Guards convert's and plan's warnings: their exact text and class, and the user's
    line as their place (it was bnswap/convert.py's for a pattern warning from convert)."""
    assert _warnings_of(bnswap.convert, nn.Sequential(nn.Linear(2, 2))) == [
        (UserWarning, "bnswap.convert: the model has no BatchNorm layer; nothing was swapped", True)
    ]
    from tests.plan_models import BatchNormTimesTwo

    only_sync = nn.Sequential(*[BatchNormTimesTwo(3) for _ in range(2)])  # (no adapter)
    none = (
        "bnswap.convert: none of the model's 2 BatchNorm layers can be swapped: "
        "BatchNormTimesTwo overrides forward: '0', '1'; a subclass that overrides forward "
        "needs an adapter (bnswap.register; the 'Adapters' guide of bnswap's documentation); "
        "bnswap.plan(model) shows "
        "each layer and why"
    )
    assert _warnings_of(bnswap.convert, only_sync) == [(UserWarning, none, True)]
    # what include / exclude leave out is what the user asked for: not warned about; the
    # layer they selected and bnswap cannot swap is (issue 26: it was not, with a pattern)
    assert _warnings_of(bnswap.convert, only_sync, exclude=["0", "1"]) == []
    assert _warnings_of(bnswap.convert, only_sync, include="1") == [
        (
            UserWarning,
            "bnswap.convert: 1 of the model's 2 BatchNorm layers was not swapped "
            "(kept its own forward): BatchNormTimesTwo overrides forward: '1'; a subclass that "
            "overrides forward needs an adapter (bnswap.register; the 'Adapters' guide of "
            "bnswap's documentation); "
            "bnswap.plan(model) shows each layer and why",
            True,
        )
    ]
    assert _warnings_of(bnswap.convert, only_sync, include="*") == [(UserWarning, none, True)]
    # a pattern that matches nothing, from convert (two calls deep) and from plan
    from bnswap.plan import UnmatchedPatternWarning

    for fn in (bnswap.convert, bnswap.plan):
        assert _warnings_of(fn, only_sync, include="x*") == [
            (
                UnmatchedPatternWarning,
                "bnswap: include pattern 'x*' matches no BatchNorm layer",
                True,
            )
        ]


def test_convert_warns_once_per_call_about_layers_it_left_that_were_not_excluded():
    """Issue 26: convert left a layer it cannot swap (a subclass overriding forward, a
    forward set on the instance) in silence unless the script configured logging. Now one
    UserWarning per call, at the caller's line, with how many and why; a layer the user
    excluded is not counted; the model converts as before (stock's outputs)."""
    from tests.plan_models import mixed_net

    torch.manual_seed(0)
    stock = mixed_net()
    x = torch.randn(4, 3, 6, 6)
    stock(x)  # (its LazyLinear initialized before the copies)
    model = copy.deepcopy(stock)
    both = (
        "bnswap.convert: 2 of the model's 4 BatchNorm layers were not swapped (kept their "
        "own forward): its forward is set on the instance (by a library's hook, e.g. "
        "accelerate's, or by hand): '2'; BatchNormTimesTwo overrides forward: '3'; a "
        "subclass that overrides forward needs an adapter (bnswap.register; the 'Adapters' "
        "guide of bnswap's documentation); bnswap.plan(model) shows each layer and why"
    )
    for _ in range(2):  # once per call, again on the next (convert is idempotent)
        assert _warnings_of(bnswap.convert, model) == [(UserWarning, both, True)]
    assert [bnswap.is_swapped(m) for m in bns(model)] == [True, False, False, True]
    assert torch.equal(model(x), stock(x))
    one = copy.deepcopy(stock)
    assert _warnings_of(bnswap.convert, one, exclude="3") == [
        (
            UserWarning,
            "bnswap.convert: 1 of the model's 4 BatchNorm layers was not swapped "
            "(kept its own forward): its forward is set on the instance (by a library's hook, "
            "e.g. accelerate's, or by hand): '2'; bnswap.plan(model) shows each layer and "
            "why",
            True,
        )
    ]
    assert _warnings_of(bnswap.convert, copy.deepcopy(stock), exclude=["2", "3"]) == []
    assert _warnings_of(bnswap.convert, net()) == []  # every layer swapped: nothing to say


def test_convert_with_sync_batchnorm_warns_about_swapped_layers_left_unsynchronized():
    """A newcomer's find (issue 26): convert(model, sync_batchnorm=True) left a BatchNorm
    subclass (it keeps torch's forward, so it is swapped) unsynchronized in silence, so
    under DDP it normalized with each rank's batch. It warns, naming the layer and why;
    the exact classes are synchronized and say nothing."""

    class KeepBN(nn.BatchNorm2d):
        pass

    model = nn.Sequential(KeepBN(3), nn.BatchNorm2d(3))
    assert _warnings_of(bnswap.convert, model, sync_batchnorm=True) == [
        (
            UserWarning,
            "bnswap.convert: 1 swapped layer stays unsynchronized with "
            "sync_batchnorm=True: sync_batchnorm=True converts BatchNorm1d/2d/3d (exact class, "
            "not parametrized) and timm's BatchNormAct2d: '0'; bnswap.plan(model) shows each "
            "layer and why",
            True,
        )
    ]
    assert isinstance(model[1], nn.SyncBatchNorm) and type(model[0]) is KeepBN
    assert _warnings_of(bnswap.convert, nn.Sequential(nn.BatchNorm2d(3)), sync_batchnorm=True) == []


def test_plan_apply_and_convert_of_a_model_warn_once_for_a_pattern_that_matches_nothing():
    """Each call the user makes warns once about a pattern that matches no layer:
    ``plan`` (and then ``apply``, which does not plan again, not at all), ``convert``
    (which plans once), ``plan(...).apply()`` in one line; and the layers are swapped as
    without the pattern: the same outputs and statistics as stock on an identical copy."""
    from bnswap.plan import UnmatchedPatternWarning

    text = "bnswap: exclude pattern 'nomatch*' matches no BatchNorm layer"

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))

    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    calls = [
        lambda m: bnswap.plan(m, exclude=["nomatch*"]),
        lambda m: bnswap.plan(m, exclude=["nomatch*"]).apply(),
        lambda m: bnswap.convert(m, exclude=["nomatch*"]),
    ]
    for i, call in enumerate(calls):
        model, stock = net(), net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call(model)
        assert [
            str(w.message) for w in caught if issubclass(w.category, UnmatchedPatternWarning)
        ] == [text], i
        if isinstance(out, bnswap.Plan):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = out.apply()
            assert caught == []
        assert out is model and bnswap.is_swapped(model[1]) and bnswap.is_swapped(model[3])
        assert torch.equal(model(x), stock(x))
        for k, v in stock.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k


def test_a_swapped_layer_takes_its_input_by_keyword():
    """Guards the swapped forward passing keyword arguments on: ``bn(input=x)`` works on
    stock's layer, so it must on a swapped one (same output and statistics)."""
    ref = nn.BatchNorm2d(3)
    layer = bnswap.convert(copy.deepcopy(ref))
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(layer(input=x), ref(input=x))
    assert torch.equal(layer.running_var, ref.running_var)
    assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == 1


def test_a_layer_whose_forward_is_set_on_the_instance_is_left_as_is():
    """Guards: a forward assigned to the instance (accelerate's ``add_hook_to_module``
    does ``module.forward = ...``) was silently replaced by the swap, so the hook stopped
    running. plan skips the layer and says why; convert and revert leave it alone."""

    def hooked(layer):
        calls = []
        plain = layer.forward

        def forward(x):
            calls.append(x.shape)
            return plain(x) * 2

        layer.forward = forward
        return calls

    ref = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    model = copy.deepcopy(ref)
    ref_calls, calls = hooked(ref[1]), hooked(model[1])
    own = vars(model[1])["forward"]
    rows = bnswap.plan(model).rows
    assert [(r.name, r.action, r.reason) for r in rows] == [
        (
            "1",
            "skip",
            "its forward is set on the instance (by a library's hook, e.g. "
            "accelerate's, or by hand); swapping would drop it",
        ),
        ("2", "swap", "-"),
    ]
    with pytest.warns(UserWarning, match="1 of the model's 2 BatchNorm layers was not swapped"):
        assert bnswap.convert(model) is model
    assert vars(model[1])["forward"] is own and bnswap.is_swapped(model[2])
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(model(x), ref(x)) and calls == ref_calls == [(2, 4, 5, 5)]
    assert torch.equal(model[1].running_var, ref[1].running_var)
    bnswap.revert(model)
    assert vars(model[1])["forward"] is own and not bnswap.is_swapped(model[2])


def test_apply_of_a_plan_without_a_model_says_how_to_get_one():
    with pytest.raises(ValueError) as e:
        bnswap.Plan([]).apply()
    assert str(e.value) == "this Plan has no model to apply to (build it with bnswap.plan)"


def test_a_layer_skipped_under_ort_says_what_that_means():
    """Guards the ORT part of a skipped row's reason (plan needs no ONNX Runtime)."""
    rows = bnswap.plan(nn.Sequential(nn.BatchNorm2d(3)), backend="ort", exclude="0").rows
    assert [(r.action, r.backend, r.reason) for r in rows] == [
        (
            "skip",
            "-",
            "excluded by '0'; ORT cannot "
            "run an unswapped BatchNorm: bnswap.convert(..., backend='ort') refuses the model, "
            "BNSwap keeps its child eager",
        )
    ]
    rows = bnswap.plan(nn.Sequential(nn.SyncBatchNorm(3)), backend="ort").rows
    assert [(r.action, r.backend, r.reason) for r in rows] == [
        (
            "skip",
            "-",
            "ONNX Runtime cannot synchronize batch statistics across processes "
            "(convert refuses the model: UnsupportedLayerError)",
        )
    ]


def test_objects_without_a_dict_are_not_swapped_and_not_wrappers():
    """Guards the ``__dict__`` fallbacks: is_swapped takes any object (ints, slotted
    objects have no ``__dict__``)."""
    from bnswap._swap import wrapped_model

    class Slotted:
        __slots__ = ("forward",)

    for obj in (3, None, Slotted(), nn.BatchNorm2d(2)):
        assert bnswap.is_swapped(obj) is False
        assert wrapped_model(obj) is None


def test_a_plan_built_by_hand_defaults_to_the_aten_backend():
    model = nn.Sequential(nn.BatchNorm2d(2))
    rows = bnswap.plan(model).rows
    p = bnswap.Plan(rows, model)
    assert p.backend == "aten" and p.apply() is model and bnswap.is_swapped(model[0])


def test_plan_rows_of_already_swapped_and_excluded_layers_hold_everything():
    """Guards each field of the rows for layers already swapped (a lazy one too) and for
    excluded layers: name, module, backend, the device the kernel is predicted for,
    adapter, lazy, already, and the ORT note on a skip."""
    from bnswap.layers import batch_norm_forward

    model = nn.Sequential(nn.BatchNorm2d(2), nn.LazyBatchNorm2d(), nn.BatchNorm2d(2))
    bnswap.convert(model, exclude="2")
    rows = bnswap.plan(model, device="cuda", exclude="2").rows
    got = [
        (r.name, r.action, r.backend, r.reason, r.adapter, r.lazy, r.already, r.kernel, r.device)
        for r in rows
    ]
    cudnn = "Cudnn (predicted)" if not torch.cuda.is_available() else "Cudnn"
    assert got == [
        ("0", "keep", "aten", "already swapped", batch_norm_forward, False, True, cudnn, "cuda"),
        (
            "1",
            "keep",
            "aten",
            "already swapped; uninitialized LazyBatchNorm2d: keeps the swap when it initializes",
            batch_norm_forward,
            True,
            True,
            cudnn,
            "cuda",
        ),
        ("2", "skip", "-", "excluded by '2'", None, False, False, "-", "cuda"),
    ]
    assert [r.module for r in rows] == list(model)
    rows = bnswap.plan(model, backend="ort", exclude="2").rows
    assert rows[2].reason == (
        "excluded by '2'; ORT cannot run an unswapped BatchNorm: bnswap.convert(..., "
        "backend='ort') refuses the model, BNSwap keeps its child eager"
    )
    assert [r.backend for r in rows] == ["ort", "ort", "-"]


def test_plan_rows_of_every_kind_hold_every_field():
    """Guards each field of each kind of row (not matched by include, SyncBatchNorm, an
    instance forward, an uninitialized lazy layer swapped now, a subclass with its own
    forward): name, module, the device asked for, lazy, and the reason, which with
    backend="ort" says what a skip means there. And the warning's class for an include
    pattern that matches nothing."""
    from bnswap.plan import UnmatchedPatternWarning
    from tests.plan_models import BatchNormTimesTwo

    hooked = nn.BatchNorm2d(2)
    hooked.forward = hooked.forward  # set on the instance
    model = nn.Sequential(
        nn.BatchNorm2d(2),
        nn.BatchNorm2d(2),
        nn.SyncBatchNorm(2),
        hooked,
        nn.LazyBatchNorm2d(),
        BatchNormTimesTwo(2),
    )
    include = ["0", "2", "3", "4", "5", "nothing"]
    subclass = (
        "BatchNormTimesTwo overrides forward; swapping would drop it (pytorch issue "
        "187298); register an adapter: bnswap.register(BatchNormTimesTwo, "
        "<function>), see the 'Adapters' guide of bnswap's documentation"
    )
    reasons = [
        "-",
        "not matched by include",
        "-",
        "its forward is set on the instance (by a library's hook, e.g. accelerate's, "
        "or by hand); swapping would drop it",
        "uninitialized LazyBatchNorm2d: swapped now, keeps the swap when it initializes",
        subclass,
    ]
    ort = (
        "; ORT cannot run an unswapped BatchNorm: bnswap.convert(..., backend='ort') "
        "refuses the model, BNSwap keeps its child eager"
    )
    for backend in ("aten", "ort"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = bnswap.plan(model, backend, include=include, device="cuda").rows
        assert [(w.category, str(w.message)) for w in caught] == [
            (
                UnmatchedPatternWarning,
                "bnswap: include pattern 'nothing' matches no BatchNorm layer",
            )
        ]
        swap = [True, False, backend == "aten", False, True, False]
        assert [r.name for r in rows] == [str(i) for i in range(6)]
        assert [r.action for r in rows] == ["swap" if s else "skip" for s in swap]
        if backend == "ort":
            reasons[2] = (
                "ONNX Runtime cannot synchronize batch statistics across processes "
                "(convert refuses the model: UnsupportedLayerError)"
            )
        assert [r.reason for r in rows] == [
            reason + (ort if backend == "ort" and not s and i != 2 else "")
            for i, (reason, s) in enumerate(zip(reasons, swap, strict=True))
        ]
        assert [r.backend for r in rows] == [backend if s else "-" for s in swap]
        assert [r.lazy for r in rows] == [False, False, False, False, True, False]
        assert all(r.module is m for r, m in zip(rows, model, strict=True))
        assert all(r.device == "cuda" for r in rows)


def _dict_copy(layer: nn.Module) -> nn.Module:
    """A copy made by copying ``__dict__`` (nn.DataParallel's replicas, learn2learn's
    clone_module): it carries the original's mark (copy.copy leaves it out since issue
    32)."""
    c = layer.__new__(type(layer))
    c.__dict__ = layer.__dict__.copy()
    return c


def test_a_shallow_copy_is_swapped_and_runs_its_own_state():
    """A copy of a swapped layer's __dict__ carries the swap's mark, which names no layer:
    the copy is swapped (the plan says keep) and runs its own eps / momentum / flags /
    buffers, as a stock layer with the copy's values does, and the original is
    unaffected (issue 21, item 6; issue 32: the copy once ran the original's state)."""
    import copy as _copy

    torch.manual_seed(0)
    orig = bnswap.convert(nn.BatchNorm2d(3))
    orig(torch.randn(4, 3, 5, 5))
    ref_orig = _copy.deepcopy(orig)
    bnswap.revert(ref_orig)
    c = _dict_copy(orig)
    c.eps, c.momentum = 1e-2, 0.5
    c._buffers = dict(c._buffers)  # the copied __dict__ shares the dict; replicas get their own
    c.running_mean = torch.full((3,), 0.25)  # own buffers
    c.running_var = torch.full((3,), 2.0)
    c.num_batches_tracked = torch.tensor(7)
    row = bnswap.plan(c)[0]
    assert (row.action, row.already, row.reason) == ("keep", True, "already swapped")
    stock = nn.BatchNorm2d(3, eps=1e-2, momentum=0.5)
    stock.load_state_dict(c.state_dict())
    for training in (True, False):
        c.train(training)
        stock.train(training)
        x = torch.randn(4, 3, 5, 5)
        assert torch.equal(c(x), stock(x)) and torch.equal(c.forward(x), stock.forward(x))
        for k, v in stock.state_dict().items():
            assert torch.equal(c.state_dict()[k], v), k
    assert bnswap.convert(c) is c and bnswap.is_swapped(c)
    # the original kept its own state and flags
    assert orig.training and orig.eps == 1e-5 and orig.momentum == 0.1
    for k, v in ref_orig.state_dict().items():
        assert torch.equal(orig.state_dict()[k], v), k
    assert bnswap.plan(c)[0].already and bnswap.plan(orig)[0].already


def test_failed_convert_leaves_a_shallow_copy_as_it_was(monkeypatch):
    plan_mod = sys.modules["bnswap.plan"]

    orig = bnswap.convert(nn.BatchNorm2d(3))
    c = _dict_copy(orig)
    model = nn.Sequential(c, nn.BatchNorm2d(3), nn.BatchNorm2d(3))
    mark = c.__dict__[SWAP]
    calls = []

    def failing_swap(module, adapter):
        calls.append(module)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_swap(module, adapter)

    real_swap = plan_mod.swap
    monkeypatch.setattr(plan_mod, "swap", failing_swap)
    with pytest.raises(KeyboardInterrupt):
        bnswap.convert(model)
    assert calls == [model[1], model[2]]
    assert c.__dict__[SWAP] is mark and not bnswap.is_swapped(model[1])


def test_a_layer_inside_an_excluded_batchnorm_layer_is_left_out_with_it():
    """A BatchNorm layer that is a submodule of another (timm's ``SplitBatchNorm2d`` and
    its ``aux_bn``; here without timm) follows the layer that holds it, however deep and
    after layers that hold nothing (plan keeps only the rows of layers with submodules
    to find it); the others are swapped."""

    class Holder(nn.BatchNorm2d):
        def __init__(self, c: int) -> None:
            super().__init__(c)
            self.aux = nn.Sequential(nn.BatchNorm2d(c))

    model = nn.Sequential(nn.BatchNorm2d(2), Holder(2), Holder(2))
    rows = bnswap.plan(model, exclude="1")
    assert [(r.name, r.action, r.reason) for r in rows] == [
        ("0", "swap", "-"),
        ("1", "skip", "excluded by '1'"),
        ("1.aux.0", "skip", "excluded with the BatchNorm layer it is part of, '1'"),
        ("2", "swap", "-"),
        ("2.aux.0", "swap", "-"),
    ]
