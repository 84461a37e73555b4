"""Atomic convert: if the k-th layer's conversion fails, the model afterwards is
structurally and bitwise identical to before, hooks included.

The one test double of the suite: ``bnswap.plan.swap`` (the per-layer step of
``Plan.apply``)
is wrapped to raise on its k-th call, for every k; the other calls do the real swap.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import bnswap
from tests._helpers import state_diff

# bnswap.plan is the function (bnswap/__init__ re-exports it); the module is here:
plan_mod = importlib.import_module("bnswap.plan")


CALLS: list[str] = []


# Module-level hooks (picklable by reference).
def pre_hook(module, args):
    CALLS.append(f"pre:{type(module).__name__}")


def fwd_hook(module, args, kwargs, out):
    CALLS.append("fwd")
    return out * 1.0


def bwd_hook(module, grad_in, grad_out):
    CALLS.append("bwd")


def sd_hook(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "extra_from_hook"] = torch.tensor(1.0)


def load_pre_hook(module, state_dict, prefix, *args):
    state_dict.pop(prefix + "extra_from_hook", None)


class Positive(nn.Module):
    def forward(self, w):
        return w.abs() + 0.1


class Block(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.bn1 = nn.BatchNorm1d(5, momentum=None)
        self.shared = shared
        self.bn3 = nn.BatchNorm3d(2, affine=False)

    def forward(self, x):
        return self.bn1(self.lin(x))


def build(parametrized: bool = True, lazy: bool = True) -> nn.Module:
    torch.manual_seed(0)
    shared = nn.BatchNorm2d(4, track_running_stats=False)
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(3, 4, 3),
            lazy=nn.LazyBatchNorm2d() if lazy else nn.Identity(),
            pbn=nn.BatchNorm2d(4),
            bn=nn.BatchNorm2d(4),
            shared_a=shared,
            block=Block(shared),
        )
    )
    bn = model.bn
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.weight.uniform_(0.5, 2)
    bn.register_forward_pre_hook(pre_hook)
    bn.register_forward_hook(fwd_hook, with_kwargs=True)
    bn.register_full_backward_hook(bwd_hook)
    bn._register_state_dict_hook(sd_hook)
    bn._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    bn.weight.register_hook(lambda g: g)  # a tensor hook on a Parameter
    bn.qconfig = "a user attribute"
    if parametrized:
        parametrize.register_parametrization(model.pbn, "weight", Positive())
    return model


def n_swaps(model: nn.Module) -> int:
    return len(bnswap.plan(model).swapped)


def _tensor_row(v: torch.Tensor):
    if isinstance(v, nn.parameter.UninitializedTensorMixin):
        return (type(v), None)  # a lazy layer's placeholder: no data yet
    return (type(v), v.detach().clone())


def snapshot(model: nn.Module) -> list[tuple]:
    """Everything about every module: identity, class, attribute dict (identity of
    each value, tensors bitwise), parameter / buffer / submodule / hook dicts."""
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        row = [name, id(m), type(m)]
        for k, v in sorted(vars(m).items()):
            if isinstance(v, torch.Tensor):
                row.append(
                    (
                        k,
                        id(v),
                        _tensor_row(v),
                        v.requires_grad,
                        dict(getattr(v, "_backward_hooks", None) or {}),
                    )
                )
            elif isinstance(v, dict):
                items = []
                for kk, vv in v.items():
                    if isinstance(vv, torch.Tensor):
                        items.append((kk, id(vv), _tensor_row(vv)))
                    else:
                        items.append((kk, id(vv), vv if not isinstance(vv, nn.Module) else None))
                row.append((k, type(v), id(v), items))
            else:
                row.append((k, id(v) if isinstance(v, (type, nn.Module)) else v))
        out.append(tuple(row))
    return out


def assert_same(before: list[tuple], after: list[tuple]) -> None:
    assert len(before) == len(after)
    for rb, ra in zip(before, after, strict=True):
        assert rb[:3] == ra[:3], (rb[:3], ra[:3])  # name, object, class (by identity)
        assert len(rb) == len(ra), (rb[0], [x[0] for x in rb[3:]], [x[0] for x in ra[3:]])
        for xb, xa in zip(rb[3:], ra[3:], strict=True):
            _same_value(xb, xa, rb[0])


def _same_value(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.numel() == 0 and b.numel() == 0), where
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for x, y in zip(a, b, strict=True):
            _same_value(x, y, where)
    else:
        assert a == b, (where, a, b)


class Injected(RuntimeError):
    pass


def _fail_on(monkeypatch, k: int, exc: type[BaseException] = Injected) -> list[int]:
    real = plan_mod.swap
    calls = [0]

    def swap(module, adapter):
        calls[0] += 1
        if calls[0] == k:
            raise exc(f"injected failure on swap {k}")
        return real(module, adapter)

    monkeypatch.setattr(plan_mod, "swap", swap)
    return calls


def test_the_model_has_every_kind_of_layer():
    model = build()
    plan = bnswap.plan(model)
    # every kind is undone by some k (the last one's own swap is the failing one)
    assert [r.name for r in plan.swapped] == [
        "lazy",
        "pbn",
        "bn",
        "shared_a",
        "block.bn1",
        "block.bn3",
    ]
    assert n_swaps(model) == 6


@pytest.mark.parametrize("k", range(1, 7))
def test_kth_failure_leaves_the_model_identical(monkeypatch, k):
    model = build()
    assert n_swaps(model) == 6
    before = snapshot(model)
    ref = build()  # (a model with an uninitialized lazy layer cannot be deepcopied)
    calls = _fail_on(monkeypatch, k)
    with pytest.raises(Injected, match=f"swap {k}"):
        bnswap.convert(model)
    assert calls[0] == k
    assert_same(before, snapshot(model))
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    assert "forward" not in vars(model.lazy)
    # hooks still fire, state_dict hooks still apply, the answer is stock's
    monkeypatch.undo()
    x = torch.randn(4, 3, 6, 6)
    CALLS.clear()
    y = model.bn(model.conv(x))
    y.sum().backward()
    assert CALLS == ["pre:BatchNorm2d", "fwd", "bwd"]
    assert "bn.extra_from_hook" in model.state_dict()
    y_ref = ref.bn(ref.conv(x))
    y_ref.sum().backward()
    assert torch.equal(y, y_ref)
    assert state_diff(model.bn, ref.bn) == []  # statistics, parameters and gradients
    # and a later convert succeeds
    bnswap.convert(model)
    assert n_swaps(model) == 6 and all(
        bnswap.is_swapped(m)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) or m is model.lazy
    )


@pytest.mark.parametrize("k", [1, 3, 6])
def test_kth_failure_by_keyboard_interrupt_is_rolled_back_too(monkeypatch, k):
    model = build()
    before = snapshot(model)
    _fail_on(monkeypatch, k, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        bnswap.convert(model)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_kth_failure_pickles_to_the_same_bytes(monkeypatch, k):
    # Without parametrizations (not picklable) and lazy layers, the whole model pickles:
    # identical bytes before and after the failed convert.
    model = build(parametrized=False, lazy=False)
    assert n_swaps(model) == 5
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    before = pickle.dumps(model)
    _fail_on(monkeypatch, k)
    with pytest.raises(Injected):
        bnswap.convert(model)
    assert pickle.dumps(model) == before
    buf2 = io.BytesIO()
    torch.save(model.state_dict(), buf2)
    assert buf.getvalue() == buf2.getvalue()


def test_failure_with_include_exclude_patterns(monkeypatch):
    model = build()
    before = snapshot(model)
    _fail_on(monkeypatch, 2)
    with pytest.raises(Injected):
        bnswap.convert(model, include=["block.*", "bn"], exclude=[nn.BatchNorm3d])
    assert_same(before, snapshot(model))


def test_revert_after_success_restores_the_same_structure():
    # The inverse direction: convert then revert is structurally the original again
    # (same objects, classes, hooks, tensors), parametrized layers included.
    model = build()
    before = snapshot(model)
    bnswap.revert(bnswap.convert(model))
    assert_same(before, snapshot(model))


def test_an_interrupt_right_after_a_swap_is_rolled_back_too(monkeypatch):
    """Guards a window: the undo used to be recorded after the layer was swapped, so an
    interrupt between the two left that layer swapped."""
    real = plan_mod.swap
    calls = [0]

    def swap_then_interrupt(module, adapter):
        real(module, adapter)
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(plan_mod, "swap", swap_then_interrupt)
    model = nn.Sequential(*[nn.BatchNorm2d(2) for _ in range(3)])
    with pytest.raises(KeyboardInterrupt):
        bnswap.plan(model).apply()
    assert [bnswap.is_swapped(m) for m in model] == [False, False, False]
