"""Checkpoint matrix: state dicts and whole models move between stock and bnswap.

Stock to bnswap and back with strict=True; an old (version 1) checkpoint without
num_batches_tracked; a model built on the meta device and loaded with
``load_state_dict(assign=True)``; ``torch.save`` / ``torch.load(weights_only=True)``
of state dicts; ``copy.deepcopy`` and pickling of whole converted models. Every
result is compared with the same operation on stock models (bitwise).
"""

from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

import bnswap
from tests._helpers import outcome, run_where_bnswap_cannot_be_imported, state_diff, train_then_eval


def build() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4, momentum=None),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.BatchNorm1d(5, affine=False),
    )


def trained(seed: int = 0, steps: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    m = build()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        m(torch.randn(6, 3, 5, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m


def converted(m: nn.Module) -> nn.Module:
    return bnswap.convert(m)


def assert_run_alike(a: nn.Module, b: nn.Module, steps: int = 3) -> None:
    """Same outputs, gradients and statistics over train and eval steps."""
    g = torch.Generator().manual_seed(123)
    for i in range(steps):
        x = torch.randn(6, 3, 5, 5, generator=g)
        for m in (a, b):
            m.train(i != 1)
            m.zero_grad()
        ya, yb = a(x), b(x)
        assert torch.equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
        assert state_diff(a, b) == []


def _bytes(sd) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


def test_state_dicts_have_the_same_keys_metadata_and_values():
    stock = trained()
    swapped = converted(copy.deepcopy(stock))
    ss, sb = stock.state_dict(), swapped.state_dict()
    assert list(ss) == list(sb)
    assert ss._metadata == sb._metadata
    assert all(torch.equal(ss[k], sb[k]) and ss[k].dtype == sb[k].dtype for k in ss)


def test_stock_checkpoint_into_bnswap_strict():
    stock = trained()
    fresh = converted(build())
    result = fresh.load_state_dict(_load(stock.state_dict()), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert all(bnswap.is_swapped(m) for m in fresh.modules() if isinstance(m, _BatchNorm))
    assert state_diff(stock, fresh) == []
    assert_run_alike(stock, fresh)


def test_bnswap_checkpoint_into_stock_strict():
    swapped = converted(trained())
    fresh = build()
    result = fresh.load_state_dict(_load(swapped.state_dict()), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert state_diff(swapped, fresh) == []
    assert_run_alike(fresh, swapped)


def _load(sd):
    """torch.save then torch.load(weights_only=True): what a checkpoint file gives."""
    return torch.load(_bytes(sd), weights_only=True)


def test_weights_only_round_trip_of_both_state_dicts():
    stock = trained()
    swapped = converted(copy.deepcopy(stock))
    for src in (stock, swapped):
        sd = _load(src.state_dict())
        assert sd._metadata == stock.state_dict()._metadata
        for dst in (build(), converted(build())):
            dst.load_state_dict(sd, strict=True)
            assert state_diff(dst, stock) == []


def _old_checkpoint(model: nn.Module) -> dict:
    """A pre-1.2 checkpoint: no num_batches_tracked, BatchNorm metadata version 1."""
    sd = model.state_dict()
    for k in [k for k in sd if k.endswith("num_batches_tracked")]:
        del sd[k]
        sd._metadata[k[: -len("num_batches_tracked")].rstrip(".")]["version"] = 1
    return sd


@pytest.mark.parametrize("into", ["stock", "bnswap"])
def test_old_checkpoint_without_num_batches_tracked(into):
    src = trained()
    sd = _old_checkpoint(src)
    stock_dst, dst = trained(seed=1), trained(seed=1)
    if into == "bnswap":
        converted(dst)
    a = stock_dst.load_state_dict(copy.deepcopy(sd), strict=True)
    b = dst.load_state_dict(copy.deepcopy(sd), strict=True)
    assert (a.missing_keys, a.unexpected_keys) == (b.missing_keys, b.unexpected_keys) == ([], [])
    # _NormBase keeps the layer's own counter for a version-1 checkpoint
    assert state_diff(stock_dst, dst) == []
    assert int(dst[1].num_batches_tracked) == 3
    assert_run_alike(stock_dst, dst)


def test_checkpoint_missing_num_batches_tracked_at_version_2_fails_as_stock():
    sd = trained().state_dict()
    del sd["1.num_batches_tracked"]
    a = outcome(lambda: build().load_state_dict(copy.deepcopy(sd), strict=True))
    b = outcome(lambda: converted(build()).load_state_dict(copy.deepcopy(sd), strict=True))
    assert a[0] == "err" and a[1][0] is b[1][0] is RuntimeError
    # the messages name the class: "Error(s) in loading state_dict for Sequential"
    assert a[1][1] == b[1][1] and "1.num_batches_tracked" in a[1][1]


@pytest.mark.parametrize(
    "kw",
    [{}, {"momentum": None}, {"track_running_stats": False}, {"affine": False}],
    ids=["default", "cma", "no_tracking", "no_affine"],
)
@pytest.mark.parametrize("parametrized", [False, True], ids=["plain", "parametrized"])
def test_whole_model_pickle_without_num_batches_tracked_runs_as_stock(kw, parametrized):
    """A torch 0.3-era whole-model pickle (issue 46): its layers have no
    num_batches_tracked at all (neither a buffer nor an attribute). Stock reads it only
    where it counts a batch (training with track_running_stats: AttributeError there);
    the converted model evaluates, trains and fails exactly where stock does, with
    stock's error and no state changed."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, **kw))
    if stock[1].running_mean is not None:
        with torch.no_grad():
            stock[1].running_mean.uniform_(-1, 1)
            stock[1].running_var.uniform_(0.5, 2)
    del stock[1].num_batches_tracked
    swapped = torch.load(_bytes(stock), weights_only=False)
    if parametrized:  # (after loading: torch pickles no parametrized module)
        name = "weight" if stock[1].weight is not None else "running_mean"
        for m in (stock, swapped):
            parametrize.register_parametrization(m[1], name, nn.Identity())
    assert not hasattr(stock[1], "num_batches_tracked")
    converted(swapped)
    assert bnswap.is_swapped(swapped[1]) and not hasattr(swapped[1], "num_batches_tracked")
    x = torch.randn(2, 3, 3, 3)
    for training in (False, True, False):
        a = outcome(lambda m=stock, t=training: m.train(t)(x))
        b = outcome(lambda m=swapped, t=training: m.train(t)(x))
        assert a[0] == b[0], (a, b)
        if a[0] == "ok":
            assert torch.equal(a[1], b[1])
        else:
            assert a[1] == b[1] and a[1][0] is AttributeError
            assert a[1][1].endswith("object has no attribute 'num_batches_tracked'")
        assert state_diff(stock, swapped) == []
    assert a[0] == "ok"  # eval runs; training fails exactly where the layer counts
    tracks = kw.get("track_running_stats", True)
    assert outcome(lambda: swapped.train()(x))[0] == ("err" if tracks else "ok")


@pytest.mark.parametrize("old", [False, True])
def test_meta_device_model_loaded_with_assign(old):
    src = trained()
    sd = _old_checkpoint(src) if old else src.state_dict()
    models = []
    for convert_it in (False, True):
        with torch.device("meta"):
            m = build()
        if convert_it:
            bnswap.convert(m)
            assert all(bnswap.is_swapped(x) for x in m.modules() if isinstance(x, _BatchNorm))
        m.load_state_dict(copy.deepcopy(sd), strict=True, assign=True)
        assert all(t.device.type == "cpu" for t in m.state_dict().values())
        assert all(
            bnswap.is_swapped(x) == convert_it for x in m.modules() if isinstance(x, _BatchNorm)
        )
        models.append(m)
    stock, swapped = models
    assert state_diff(stock, swapped) == []
    if old:  # a meta layer has no counter to keep: stock starts it at 0
        assert int(swapped[1].num_batches_tracked) == 0
    else:
        assert torch.equal(swapped[1].running_var, src[1].running_var)
    assert_run_alike(stock, swapped)


def test_meta_device_model_converted_then_materialized():
    with torch.device("meta"):
        stock = build()
    swapped = converted(copy.deepcopy(stock))
    assert [r.kernel for r in bnswap.plan(swapped).swapped] == ["n/a (meta)"] * 3
    for m in (stock, swapped):
        m.to_empty(device="cpu")
        m.load_state_dict(trained().state_dict())
    assert_run_alike(stock, swapped)


def test_deepcopy_of_a_converted_model():
    swapped = converted(trained())
    clone = copy.deepcopy(swapped)
    assert [type(m) for m in clone.modules()] == [type(m) for m in swapped.modules()]
    for (k, a), (_, b) in zip(
        swapped.state_dict().items(), clone.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), k
    stock = trained()
    assert_run_alike(stock, clone)
    assert not torch.equal(clone[1].running_mean, swapped[1].running_mean)  # independent


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickling_a_whole_converted_model(how):
    """A whole converted model pickles as stock's: nothing of bnswap's in the bytes, and it
    loads as stock's layers (issue 32); bnswap.convert after loading swaps it again."""
    swapped = converted(trained())
    data = pickle.dumps(swapped) if how == "pickle" else _bytes(swapped).getvalue()
    assert b"bnswap" not in data
    clone = (
        pickle.loads(data) if how == "pickle" else torch.load(io.BytesIO(data), weights_only=False)
    )
    assert [type(m) for m in clone.modules()] == [type(m) for m in swapped.modules()]
    assert not any(bnswap.is_swapped(m) or "forward" in vars(m) for m in clone.modules())
    assert state_diff(clone, swapped) == []
    ref = trained()
    assert_run_alike(ref, clone)
    assert bnswap.convert(clone) is clone and isinstance(clone[1], bnswap.BatchNorm2d)
    assert_run_alike(ref, clone)
    assert bnswap.is_swapped(swapped[1])  # pickling left the original as it was


def test_copy_copy_of_a_converted_layer_is_a_stock_copy():
    """copy.copy leaves the swap out (issue 32): the copy runs its class's forward, as
    stock's copy does, and the original stays swapped."""
    swapped = converted(trained())
    c = copy.copy(swapped[1])
    assert "forward" not in vars(c) and bnswap.is_swapped(swapped[1])
    ref = copy.copy(trained()[1])
    x = torch.randn(6, 4, 3, 3)
    assert torch.equal(c(x), ref(x))
    assert state_diff(c, ref) == []


def test_weights_only_load_of_a_whole_model_fails_as_stock():
    a = outcome(lambda: torch.load(_bytes(trained()), weights_only=True))
    b = outcome(lambda: torch.load(_bytes(converted(trained())), weights_only=True))
    assert a[0] == b[0] == "err" and a[1][0] is b[1][0]


@pytest.mark.skipif(
    not hasattr(torch.serialization, "safe_globals"),
    reason="torch.serialization.safe_globals: torch >= 2.5",
)
def test_weights_only_load_of_a_whole_model_needs_stocks_allowlist_only():
    """A whole converted model loads with weights_only=True once its classes are
    allowlisted as stock's must be (issue 21); nothing of bnswap's is needed since issue
    32 (bnswap.safe_globals() stays accepted)."""
    swapped = converted(trained())
    stock_classes = sorted({type(m) for m in swapped.modules()}, key=str)
    for extra in ([], bnswap.safe_globals()):
        with torch.serialization.safe_globals([*stock_classes, *extra]):
            clone = torch.load(_bytes(swapped), weights_only=True)
        assert not bnswap.is_swapped(clone[1])
        assert state_diff(clone, swapped) == []
        assert_run_alike(trained(), clone)


@pytest.mark.skipif(
    not hasattr(torch.serialization, "safe_globals"),
    reason="torch.serialization.safe_globals: torch >= 2.5",
)
def test_a_synchronized_model_pickles_as_stocks_synchronized_model():
    """Guards (a newcomer's try): a convert(..., sync_batchnorm=True) SyncBatchNorm kept
    its original BatchNorm layer (for revert) in the pickle: b"bnswap" in the file, stock's
    allowlist refused it, and revert after loading gave the BatchNorm back. It pickles as
    torch's convert_sync_batchnorm model does; deepcopy keeps the original."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 5), nn.BatchNorm1d(5)
    )
    stock = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    ours = bnswap.convert(model, sync_batchnorm=True)
    data = _bytes(ours).getvalue()
    assert b"bnswap" not in data
    with torch.serialization.safe_globals(sorted({type(m) for m in stock.modules()}, key=str)):
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in stock.modules()]
    assert [sorted(vars(m)) for m in loaded.modules()] == [sorted(vars(m)) for m in stock.modules()]
    assert state_diff(loaded, stock) == []
    assert type(bnswap.revert(bnswap.convert(loaded))[1]) is nn.SyncBatchNorm
    assert type(bnswap.revert(copy.deepcopy(ours))[1]) is nn.BatchNorm2d


def test_uninitialized_lazy_model_deepcopy_and_pickle_as_stock():
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d())
    swapped = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d())
    swapped.load_state_dict(stock.state_dict())
    bnswap.convert(swapped)
    for fn in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        a, b = outcome(lambda fn=fn: fn(stock)), outcome(lambda fn=fn: fn(swapped))
        assert a[0] == b[0]
        if a[0] == "err":
            assert a[1][0] is b[1][0]
        else:
            x = torch.randn(2, 3, 5, 5)
            assert torch.equal(a[1](x), b[1](x))
            # deepcopy keeps the swap; a pickle carries none (issue 32)
            assert bnswap.is_swapped(b[1][1]) is (fn is copy.deepcopy)


class _Positive(nn.Module):
    def forward(self, w):
        return w.abs() + 0.1


def test_parametrized_converted_model_deepcopy_and_pickle_as_stock():
    stock = trained()
    parametrize.register_parametrization(stock[1], "weight", _Positive())
    swapped = copy.deepcopy(stock)
    bnswap.convert(swapped)
    assert isinstance(swapped[1], bnswap.BatchNorm2d)
    a, b = outcome(lambda: copy.deepcopy(stock)), outcome(lambda: copy.deepcopy(swapped))
    assert a[0] == b[0] == "ok"
    assert isinstance(b[1][1], bnswap.BatchNorm2d) and parametrize.is_parametrized(b[1][1])
    assert_run_alike(a[1], b[1])
    # pickling parametrized modules is refused by torch, for both
    a, b = outcome(lambda: pickle.dumps(stock)), outcome(lambda: pickle.dumps(swapped))
    assert a[0] == b[0] == "err" and a[1] == b[1]
    # and the state dict moves across (parametrization keys included)
    fresh = build()
    parametrize.register_parametrization(fresh[1], "weight", _Positive())
    fresh.load_state_dict(_load(swapped.state_dict()), strict=True)
    assert state_diff(fresh, stock) == []


def test_whole_model_checkpoint_loads_where_bnswap_cannot_be_imported(tmp_path):
    """Issue 32: torch.save(model) of a converted model loads in a fresh interpreter where
    importing bnswap fails, and trains there exactly as stock's identical copy does
    (outputs, gradients, running stats after a train step, then eval)."""
    swapped = converted(trained())
    torch.save(swapped, tmp_path / "model.pt")
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, 3, 5, 5, generator=g) for _ in range(2)]
    # the reference: stock's layers, the same weights and statistics
    want = train_then_eval(trained(), xs)
    got = run_where_bnswap_cannot_be_imported(tmp_path / "model.pt", xs, tmp_path)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_subclass_with_its_own_getstate_loads_where_bnswap_cannot_be_imported(
    tmp_path, monkeypatch
):
    """A BatchNorm subclass that defines ``__getstate__`` skips the checkpoints patch's
    (``_BatchNorm.__getstate__``), so its pickle held the swap's mark, which named
    bnswap; the mark now pickles as None outside a copy for this job. The checkpoint
    loads where importing bnswap fails and runs as stock's layer; deepcopy and
    multiprocessing's pickles still keep the swap."""
    from multiprocessing import reduction

    (tmp_path / "own_getstate.py").write_text(
        "from torch import nn\n\n\n"
        "class OwnGetstateBN(nn.BatchNorm2d):\n"
        "    def __getstate__(self):\n"
        "        return self.__dict__.copy()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    from own_getstate import OwnGetstateBN

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), OwnGetstateBN(4))
    swapped = bnswap.convert(copy.deepcopy(stock))
    assert bnswap.is_swapped(swapped[1])
    assert b"bnswap." not in pickle.dumps(swapped)
    assert not bnswap.is_swapped(pickle.loads(pickle.dumps(swapped))[1])
    assert bnswap.is_swapped(copy.deepcopy(swapped)[1])
    assert bnswap.is_swapped(pickle.loads(bytes(reduction.ForkingPickler.dumps(swapped)))[1])
    torch.save(swapped, tmp_path / "model.pt")
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, 3, 5, 5, generator=g) for _ in range(2)]
    want = train_then_eval(copy.deepcopy(stock), xs)
    got = run_where_bnswap_cannot_be_imported(tmp_path / "model.pt", xs, tmp_path)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_pickle_for_another_process_keeps_the_swap():
    """multiprocessing's ForkingPickler (torch.multiprocessing.spawn's arguments, its
    queues) pickles for a process of the same job, same environment: the swap goes
    along: the copy is swapped and runs like stock (issue 32)."""
    from multiprocessing import reduction

    for how in ("dumps", "dump"):
        swapped = converted(trained())  # (the copy shares its tensors' memory: torch's
        buf = io.BytesIO()  # reductions for multiprocessing)
        if how == "dump":
            reduction.dump(swapped, buf)
        clone = pickle.loads(
            bytes(reduction.ForkingPickler.dumps(swapped)) if how == "dumps" else buf.getvalue()
        )
        assert isinstance(clone[1], bnswap.BatchNorm2d)
        assert state_diff(clone, swapped) == []
        assert_run_alike(trained(), clone)
    assert b"bnswap" not in pickle.dumps(swapped)  # a plain pickle still names nothing
