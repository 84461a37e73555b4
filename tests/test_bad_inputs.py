"""Bad inputs: what each gets from stock ``nn.BatchNorm`` and from bnswap.

The table in docs/reliability.md lists, per row, the input, stock's behaviour and
bnswap's. Layer-level rows run stock and a converted deepcopy side by side in ONE
subprocess (anything reaching a kernel with a bad shape could kill the process); each
row's test reads that row's result. Conversion-level rows run in process.

Every row checks: the same outcome as stock (value bitwise, or the same exception
type and message), gradients, statistics untouched on error (only the documented
num_batches_tracked deviation: bnswap raises before counting the batch, stock counts
first), and no NaN written into statistics unless stock writes the same NaN (NaN /
Inf inputs).
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import (
    TORCH,
    json_lines,
    outcome,
    pair,
    run_script,
    same_tensor,
    state_diff,
    stats_have_nan,
)

# --- layer-level rows, run in a subprocess ---------------------------------------------


def _x(*shape, dtype=torch.float32, fill=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        if fill is not None:
            x.view(-1)[:: max(1, x.numel() // 3)] = fill
        return x
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(0, 5, shape, generator=g, dtype=dtype)


def _fwd(x, train=True):
    def act(m):
        m.train(train)
        return m(x.clone())

    act.pure_forward = True  # the action only runs forward
    return act


def _bn(cls=nn.BatchNorm2d, c=3, **kw):
    def build():
        bn = cls(**kw) if issubclass(cls, nn.modules.lazy.LazyModuleMixin) else cls(c, **kw)
        if isinstance(bn, nn.modules.lazy.LazyModuleMixin):
            return bn  # uninitialized: nothing to randomize yet
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for t in (bn.weight, bn.bias, bn.running_mean):
                if t is not None and t.numel():
                    t.copy_(torch.randn(t.shape, generator=g))
            if bn.running_var is not None and bn.running_var.numel():
                bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=g) + 0.5)
        return bn

    return build


def _load(sd_edit, assign=False, then=None):
    def act(m):
        sd = m.state_dict()
        sd_edit(sd)
        m.load_state_dict(sd, assign=assign)
        return then(m) if then else None

    return act


def _set(name, value_fn, then):
    def act(m):
        setattr(m, name, value_fn())
        return then(m)

    return act


def _sd_shape(sd):
    sd["running_mean"] = torch.zeros(4)


def _sd_f64(sd):
    sd["running_mean"] = sd["running_mean"].double() + 0.25
    sd["running_var"] = sd["running_var"].double() * 2


def _sd_nbt_float(sd):
    sd["num_batches_tracked"] = torch.tensor(7.9)


def _sd_nbt_shape(sd):
    sd["num_batches_tracked"] = torch.tensor([7, 8])


x4 = _x(2, 3, 4, 4)
# row -> {case name: (module builder, action)}
ROWS = {
    "wrong_rank": {
        "1d_given_4d": (_bn(nn.BatchNorm1d), _fwd(x4)),
        "1d_given_1d": (_bn(nn.BatchNorm1d), _fwd(_x(3))),
        "2d_given_3d": (_bn(), _fwd(_x(2, 3, 4))),
        "2d_given_5d_eval": (_bn(), _fwd(_x(2, 3, 2, 2, 2), train=False)),
        "3d_given_4d": (_bn(nn.BatchNorm3d), _fwd(x4)),
        "lazy_2d_given_3d": (_bn(nn.LazyBatchNorm2d), _fwd(_x(2, 3, 4))),
    },
    "wrong_channels": {
        "more_train": (_bn(), _fwd(_x(2, 4, 3, 3))),
        "more_eval": (_bn(), _fwd(_x(2, 4, 3, 3), train=False)),
        "fewer_train": (_bn(), _fwd(_x(2, 2, 3, 3))),
        "notrack_train": (_bn(track_running_stats=False), _fwd(_x(2, 4, 3, 3))),
        "1d_train": (_bn(nn.BatchNorm1d, 5), _fwd(_x(4, 3))),
        "3d_eval": (_bn(nn.BatchNorm3d), _fwd(_x(2, 1, 2, 2, 2), train=False)),
        # no parameter or statistic to check against: stock normalizes the 4 channels
        "noaffine_notrack_runs": (
            _bn(affine=False, track_running_stats=False),
            _fwd(_x(2, 4, 3, 3)),
        ),
    },
    "one_value_per_channel": {
        "1d_train": (_bn(nn.BatchNorm1d), _fwd(_x(1, 3))),
        "2d_train": (_bn(), _fwd(_x(1, 3, 1, 1))),
        "3d_train": (_bn(nn.BatchNorm3d), _fwd(_x(1, 3, 1, 1, 1))),
        "momentum_none_train": (_bn(momentum=None), _fwd(_x(1, 3, 1, 1))),
        "notrack_train": (_bn(track_running_stats=False), _fwd(_x(1, 3, 1, 1))),
        "channels_last_train": (_bn(), _fwd(_x(1, 3, 1, 1).to(memory_format=torch.channels_last))),
        "eval_runs": (_bn(), _fwd(_x(1, 3, 1, 1), train=False)),
        "batch_1_spatial_4_runs": (_bn(), _fwd(_x(1, 3, 2, 2))),
    },
    "empty_batch": {
        "train": (_bn(), _fwd(_x(0, 3, 4, 4))),
        "eval": (_bn(), _fwd(_x(0, 3, 4, 4), train=False)),
        "notrack_train": (_bn(track_running_stats=False), _fwd(_x(0, 3, 4, 4))),
        "momentum_none_train": (_bn(momentum=None), _fwd(_x(0, 3, 4, 4))),
        "noaffine_train": (_bn(affine=False), _fwd(_x(0, 3, 4, 4))),
        "1d_train": (_bn(nn.BatchNorm1d), _fwd(_x(0, 3))),
        "zero_spatial_train": (_bn(), _fwd(_x(2, 3, 0, 4))),
        "wrong_channels_train": (_bn(), _fwd(_x(0, 5, 2, 2))),
        "integer_train": (_bn(), _fwd(_x(0, 3, 2, 2, dtype=torch.long))),
        "half_eval": (_bn(), _fwd(_x(0, 3, 2, 2, dtype=torch.float16), train=False)),
        "zero_channels_train": (_bn(c=0), _fwd(_x(2, 0, 2, 2))),
    },
    "nan_inf": {
        "nan_train": (_bn(), _fwd(_x(2, 3, 4, 4, fill=math.nan))),
        "nan_eval": (_bn(), _fwd(_x(2, 3, 4, 4, fill=math.nan), train=False)),
        "inf_train": (_bn(), _fwd(_x(2, 3, 4, 4, fill=math.inf))),
        "neg_inf_eval": (_bn(), _fwd(_x(2, 3, 4, 4, fill=-math.inf), train=False)),
        "nan_notrack_train": (_bn(track_running_stats=False), _fwd(_x(2, 3, 4, 4, fill=math.nan))),
        "nan_momentum_none_train": (_bn(momentum=None), _fwd(_x(2, 3, 4, 4, fill=math.nan))),
        "inf_channels_last_train": (
            _bn(),
            _fwd(_x(2, 3, 4, 4, fill=math.inf).to(memory_format=torch.channels_last)),
        ),
        "nan_half_train": (_bn(), _fwd(_x(2, 3, 4, 4, dtype=torch.float16, fill=math.nan))),
        "overflow_train": (_bn(), _fwd(_x(2, 3, 4, 4) * 3e38)),
    },
    "integer_input": {
        "int64_train": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.long))),
        "int32_eval": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.int32), train=False)),
        "uint8_eval": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.uint8), train=False)),
        "bool_train": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.bool))),
        "complex_train": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.complex64))),
        "int64_notrack_train": (
            _bn(track_running_stats=False),
            _fwd(_x(2, 3, 2, 2, dtype=torch.long)),
        ),
    },
    "dtype_mismatch": {
        "float64_input_float32_layer": (_bn(), _fwd(_x(2, 3, 2, 2, dtype=torch.float64))),
        "float32_input_float64_layer_eval": (
            _bn(dtype=torch.float64),
            _fwd(_x(2, 3, 2, 2), train=False),
        ),
    },
    "bad_state_dict": {
        "wrong_shape": (_bn(), _load(_sd_shape)),
        "wrong_shape_assign": (_bn(), _load(_sd_shape, assign=True)),
        "float64_stats_then_train": (_bn(), _load(_sd_f64, then=_fwd(x4))),
        "float64_stats_then_eval": (_bn(), _load(_sd_f64, then=_fwd(x4, train=False))),
        "float64_stats_assign_then_eval": (
            _bn(),
            _load(_sd_f64, assign=True, then=_fwd(x4, train=False)),
        ),
        "float64_stats_assign_then_train": (_bn(), _load(_sd_f64, assign=True, then=_fwd(x4))),
        "float_counter_then_train": (_bn(momentum=None), _load(_sd_nbt_float, then=_fwd(x4))),
        "counter_shape": (_bn(), _load(_sd_nbt_shape)),
    },
    "bad_buffers_set_directly": {
        "running_mean_wrong_shape_eval": (
            _bn(),
            _set("running_mean", lambda: torch.zeros(4), _fwd(x4, train=False)),
        ),
        "running_var_wrong_shape_train": (
            _bn(),
            _set("running_var", lambda: torch.ones(5), _fwd(x4)),
        ),
        "running_var_float64_train": (
            _bn(),
            _set("running_var", lambda: torch.ones(3, dtype=torch.float64), _fwd(x4)),
        ),
        "weight_wrong_shape_train": (
            _bn(),
            _set("weight", lambda: nn.Parameter(torch.ones(4)), _fwd(x4)),
        ),
        "bias_wrong_shape_eval": (
            _bn(),
            _set("bias", lambda: nn.Parameter(torch.ones(2)), _fwd(x4, train=False)),
        ),
    },
    "notrack_eval_batch_1": {
        "2d_one_value": (_bn(track_running_stats=False), _fwd(_x(1, 3, 1, 1), train=False)),
        "1d_one_value": (
            _bn(nn.BatchNorm1d, track_running_stats=False),
            _fwd(_x(1, 3), train=False),
        ),
        "2d_spatial_runs": (_bn(track_running_stats=False), _fwd(_x(1, 3, 3, 3), train=False)),
    },
    "odd_hyperparameters": {
        "momentum_negative": (_bn(momentum=-0.5), _fwd(x4)),
        "momentum_above_one": (_bn(momentum=2.0), _fwd(x4)),
        "eps_nan_train": (_bn(eps=math.nan), _fwd(x4)),
        "eps_inf_eval": (_bn(eps=math.inf), _fwd(x4, train=False)),
        "eps_zero_train": (_bn(eps=0.0), _fwd(x4)),
        "eps_negative_eval": (_bn(eps=-1.0), _fwd(x4, train=False)),
    },
    "uninitialized_lazy": {
        "train": (_bn(nn.LazyBatchNorm2d), _fwd(x4)),
        "eval": (_bn(nn.LazyBatchNorm2d), _fwd(x4, train=False)),
        "1d_notrack": (_bn(nn.LazyBatchNorm1d, track_running_stats=False), _fwd(_x(4, 3))),
        "one_value": (_bn(nn.LazyBatchNorm2d), _fwd(_x(1, 3, 1, 1))),
        "integer": (_bn(nn.LazyBatchNorm2d), _fwd(_x(2, 3, 2, 2, dtype=torch.long))),
    },
}


def _describe(r):
    return ["ok"] if r[0] == "ok" else ["err", r[1][0].__name__, r[1][1]]


def _nbt(m):
    t = getattr(m, "num_batches_tracked", None)
    return None if t is None or isinstance(t, nn.parameter.UninitializedTensorMixin) else int(t)


def _stats(m):
    return [
        None
        if t is None or isinstance(t, nn.parameter.UninitializedTensorMixin)
        else t.detach().clone()
        for t in (m.running_mean, m.running_var)
    ]


def _run_case(build, act) -> dict:
    stock, swapped = build(), build()  # builders are deterministic (lazy layers cannot
    bnswap.convert(swapped)  # be deepcopied before they initialize)
    assert bnswap.is_swapped(swapped) and state_diff(stock, swapped) == []
    before = [(_nbt(m), _stats(m)) for m in (stock, swapped)]
    # (a lazy layer's first forward initializes its statistics before anything raises)
    pure = getattr(act, "pure_forward", False) and not isinstance(
        stock, nn.modules.lazy.LazyModuleMixin
    )
    res = [outcome(lambda m=m: act(m)) for m in (stock, swapped)]
    out = {"stock": _describe(res[0]), "bnswap": _describe(res[1]), "pure_forward": pure}
    ys, yb = res[0][1], res[1][1]
    if res[0][0] == res[1][0] == "ok" and isinstance(ys, torch.Tensor):
        out["out_equal"] = same_tensor(ys, yb) and ys.stride() == yb.stride()
        out["out_has_nan"] = bool(ys.isnan().any()) if ys.is_floating_point() else False
        if ys.requires_grad and yb.requires_grad:
            go = torch.randn(ys.shape, generator=torch.Generator().manual_seed(2)).to(ys.dtype)
            ys.backward(go)
            yb.backward(go)
    out["diff"] = state_diff(stock, swapped)
    out["bnswap_type"] = type(swapped).__module__ + "." + type(swapped).__name__
    out["stock_type"] = type(stock).__module__ + "." + type(stock).__name__
    out["bnswap_still_swapped"] = bnswap.is_swapped(swapped)
    for tag, m, (nbt0, stats0) in (("stock", stock, before[0]), ("bnswap", swapped, before[1])):
        nbt1 = _nbt(m)
        out[f"{tag}_nbt_delta"] = None if nbt0 is None or nbt1 is None else nbt1 - nbt0
        s1 = _stats(m)
        out[f"{tag}_stats_changed"] = any(
            (a is None) != (b is None) or (a is not None and not same_tensor(a, b))
            for a, b in zip(stats0, s1, strict=True)
        )
        out[f"{tag}_nan_stats"] = stats_have_nan(m)
    return out


def _main() -> None:  # the subprocess
    warnings.simplefilter("ignore")
    for row, cases in ROWS.items():
        for name, (build, act) in cases.items():
            key = f"{row}/{name}"
            print(json.dumps({"start": key}), flush=True)
            print(json.dumps({"case": key, **_run_case(build, act)}), flush=True)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    rc, out, err = run_script("from tests.test_bad_inputs import _main; _main()", timeout=300)
    lines = json_lines(out)
    done = {d["case"]: d for d in lines if "case" in d}
    started = [d["start"] for d in lines if "start" in d]
    crashed = [k for k in started if k not in done]
    assert rc == 0 and not crashed, f"subprocess rc={rc}, crashed in {crashed}: {err[-2000:]}"
    assert len(done) == sum(len(c) for c in ROWS.values())
    return done


def _check_common(r: dict) -> None:
    """Same outcome as stock; state as stock (up to the documented counter deviation)."""
    assert r["stock"] == r["bnswap"], r
    if r["stock"][0] == "ok":
        assert r.get("out_equal", True), r
        assert r["diff"] == [], r
    else:
        if r["pure_forward"]:  # statistics untouched by a forward that raises
            assert not r["bnswap_stats_changed"] and not r["stock_stats_changed"], r
        # bnswap raises before counting the batch; stock counts it first
        if r["diff"]:
            assert r["diff"] == ["num_batches_tracked"], r
            assert (r["stock_nbt_delta"], r["bnswap_nbt_delta"]) == (1, 0), r
    if not r["stock_nan_stats"]:
        assert not r["bnswap_nan_stats"], r  # no NaN written where stock writes none


def _cases(row):
    return [pytest.param(f"{row}/{name}", id=name) for name in ROWS[row]]


def _err(r):
    return tuple(r["bnswap"][1:]) if r["bnswap"][0] == "err" else None


@pytest.mark.parametrize("key", _cases("wrong_rank"))
def test_wrong_rank(results, key):
    r = results[key]
    _check_common(r)
    assert _err(r)[0] == "ValueError" and "input (got" in _err(r)[1]
    assert r["diff"] == []  # the rank check comes before anything moves, in both


@pytest.mark.parametrize("key", _cases("wrong_channels"))
def test_wrong_channel_count(results, key):
    r = results[key]
    _check_common(r)
    if key.endswith("_runs"):
        assert r["bnswap"] == ["ok"]
    else:
        assert _err(r)[0] == "RuntimeError" and "should contain" in _err(r)[1]


@pytest.mark.parametrize("key", _cases("one_value_per_channel"))
def test_one_value_per_channel_in_training(results, key):
    r = results[key]
    _check_common(r)
    assert not r["bnswap_nan_stats"]
    if key.endswith("_runs"):
        assert r["bnswap"] == ["ok"]
    else:
        assert _err(r)[0] == "ValueError" and "more than 1 value per channel" in _err(r)[1]
        assert r["bnswap_nbt_delta"] in (0, None)  # the allowed deviation from stock


@pytest.mark.parametrize("key", _cases("empty_batch"))
def test_empty_batch(results, key):
    r = results[key]
    _check_common(r)
    if key.endswith("zero_channels_train"):
        assert _err(r)[0] == "IndexError"
    else:
        assert r["bnswap"] == ["ok"] and not r["bnswap_stats_changed"]
        if key.endswith(("/train", "momentum_none_train", "noaffine_train", "1d_train")):
            assert r["bnswap_nbt_delta"] == 1  # counted, as stock; statistics untouched


@pytest.mark.parametrize("key", _cases("nan_inf"))
def test_nan_and_inf_propagate_as_stock(results, key):
    r = results[key]
    _check_common(r)
    assert r["bnswap"] == ["ok"] and r["out_equal"]
    assert r["stock_nan_stats"] == r["bnswap_nan_stats"]


#: The exception stock's dtype dispatch raises for non-floating input (bnswap raises what
#: stock raises): NotImplementedError on torch 2.9 / 2.13 / 2.14 / 2.15, RuntimeError on
#: 2.4 (make compat); the release in between that changed it is not pinned down.
DTYPE_ERRORS = (NotImplementedError,) if TORCH >= (2, 9) else (NotImplementedError, RuntimeError)


@pytest.mark.parametrize("key", _cases("integer_input"))
def test_integer_input(results, key):
    r = results[key]
    _check_common(r)
    assert _err(r)[0] in {e.__name__ for e in DTYPE_ERRORS}
    assert "not implemented for" in _err(r)[1]


@pytest.mark.parametrize("key", _cases("dtype_mismatch"))
def test_input_dtype_different_from_the_layer(results, key):
    r = results[key]
    _check_common(r)
    assert _err(r)[0] == "RuntimeError" and "mixed dtype" in _err(r)[1]


@pytest.mark.parametrize("key", _cases("bad_state_dict"))
def test_state_dict_with_wrong_shape_or_dtype(results, key):
    r = results[key]
    _check_common(r)
    if key.endswith("counter_shape") and TORCH < (2, 13) and r["stock"] == ["ok"]:
        pass  # torch 2.4 / 2.9 load a (2,) counter's first element; bnswap as stock
    elif "shape" in key:
        assert _err(r)[0] == "RuntimeError" and "size mismatch" in _err(r)[1]
    # the class is stock's (bnswap swaps the forward only) and the swap survives
    assert r["bnswap_type"] == r["stock_type"] and r["bnswap_still_swapped"]


@pytest.mark.parametrize("key", _cases("bad_buffers_set_directly"))
def test_statistics_or_parameters_replaced_with_wrong_ones(results, key):
    r = results[key]
    _check_common(r)


@pytest.mark.parametrize("key", _cases("notrack_eval_batch_1"))
def test_no_running_stats_in_eval_with_batch_1(results, key):
    r = results[key]
    _check_common(r)
    if key.endswith("_runs"):
        assert r["bnswap"] == ["ok"]
    else:  # batch statistics are used in eval too: one value per channel
        assert _err(r)[0] == "ValueError"


@pytest.mark.parametrize("key", _cases("odd_hyperparameters"))
def test_odd_momentum_and_eps(results, key):
    r = results[key]
    _check_common(r)


@pytest.mark.parametrize("key", _cases("uninitialized_lazy"))
def test_uninitialized_lazy_layer(results, key):
    r = results[key]
    _check_common(r)
    if r["bnswap"] == ["ok"]:  # initialized by its first forward: into torch's class
        assert r["stock_type"].startswith("torch.nn.modules.batchnorm.BatchNorm")
        # exactly the class stock became, still swapped
        assert r["bnswap_type"] == r["stock_type"] and r["bnswap_still_swapped"]


def test_every_layer_row_ran_in_the_subprocess(results):
    assert sorted(results) == sorted(f"{row}/{n}" for row, c in ROWS.items() for n in c)


# --- conversion-level rows, in process -------------------------------------------------


@pytest.mark.parametrize(
    "obj", [None, 3, "model", torch.randn(2), [nn.BatchNorm2d(3)], nn.BatchNorm2d]
)
@pytest.mark.parametrize("fn", ["convert", "plan", "revert"])
def test_non_module_is_a_type_error(fn, obj):
    with pytest.raises(
        TypeError,
        match=rf"^bnswap\.{fn}\(\) expects a torch\.nn\.Module, "
        f"got {type(obj).__name__}$",
    ):
        getattr(bnswap, fn)(obj)


@pytest.mark.parametrize("backend", ["cudnn", "ATEN", "", "onnx"])
def test_unknown_backend_is_a_value_error_naming_the_choices(backend):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ref = copy.deepcopy(model)
    for fn in (bnswap.convert, bnswap.plan):
        with pytest.raises(ValueError, match=r"unknown backend .*'aten', 'ort'") as e:
            fn(model, backend)
        assert repr(backend) in str(e.value)
    assert type(model[1]) is nn.BatchNorm2d and state_diff(model, ref) == []


def _model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.BatchNorm1d(5),
    )


@pytest.mark.parametrize(
    "kw,expect_swapped,warned",
    [
        ({"include": "nothing*"}, 0, ["include pattern 'nothing*'"]),
        ({"include": ["1", "zz"]}, 1, ["include pattern 'zz'"]),
        (
            {"exclude": ["zz", nn.BatchNorm3d]},
            2,
            ["exclude pattern 'zz'", "exclude pattern BatchNorm3d"],
        ),
        ({"include": "0"}, 0, ["include pattern '0'"]),  # matches a conv, not a BatchNorm
        ({"exclude": "*"}, 0, []),
        ({"include": nn.BatchNorm1d}, 1, []),
    ],
)
def test_patterns_that_match_nothing_warn_naming_the_pattern(kw, expect_swapped, warned):
    model = _model()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        bnswap.convert(model, **kw)
    msgs = [str(x.message) for x in w if issubclass(x.category, UserWarning)]
    assert len(msgs) == len(warned), msgs
    for m, part in zip(msgs, warned, strict=True):
        assert part in m and "matches no BatchNorm layer" in m
    assert sum(bnswap.is_swapped(m) for m in model.modules()) == expect_swapped
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(model(x), ref(x))


def test_converting_a_converted_model_is_a_no_op():
    model = _model()
    ref = copy.deepcopy(model)
    bnswap.convert(model, include="1")  # partly converted
    first = [bnswap.is_swapped(m) for m in model.modules()]
    entry = vars(model[1])[bnswap._swap.SWAP]
    bnswap.convert(model)  # converts the rest
    second = [bnswap.is_swapped(m) for m in model.modules()]
    assert first[2] and second[2] and vars(model[1])[bnswap._swap.SWAP] is entry
    assert not first[5] and second[5]
    objs = [id(m) for m in model.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bnswap.convert(model) is model
        assert bnswap.convert(model) is model
    assert [bnswap.is_swapped(m) for m in model.modules()] == second
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert [id(m) for m in model.modules()] == objs
    assert all(r.reason == "already swapped" for r in bnswap.plan(model).swapped)
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(model(x), ref(x)) and state_diff(model, ref) == []
    bnswap.revert(model)  # one revert restores stock
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())


def test_uninitialized_lazy_layer_becomes_bnswap_when_it_initializes():
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d(momentum=None))
    swapped = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d(momentum=None))
    swapped.load_state_dict(stock.state_dict())
    bnswap.convert(swapped)
    row = bnswap.plan(swapped)[0]
    assert row.action == "keep" and "when it initializes" in row.reason
    assert type(swapped[1]) is nn.LazyBatchNorm2d and bnswap.is_swapped(swapped[1])
    for _ in range(3):
        x = torch.randn(4, 3, 5, 5)
        assert torch.equal(stock(x), swapped(x))
        assert state_diff(stock, swapped) == []
    assert type(stock[1]) is type(swapped[1]) is nn.BatchNorm2d
    assert isinstance(swapped[1], bnswap.BatchNorm2d) and bnswap.is_swapped(swapped[1])
    # reverted before it initializes: it becomes the stock class, unswapped
    lazy = bnswap.revert(bnswap.convert(nn.LazyBatchNorm1d()))
    lazy(torch.randn(4, 3))
    assert type(lazy) is nn.BatchNorm1d and not bnswap.is_swapped(lazy)


class BatchNormReLU(nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x))


class PlainSubclass(nn.BatchNorm2d):
    pass


def test_subclass_with_its_own_forward_is_left_as_is():
    """A subclass overriding forward is skipped (its behaviour would be lost); one that
    keeps torch's forward runs torch's adapter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormReLU(4), PlainSubclass(4), nn.BatchNorm2d(4))
    ref = copy.deepcopy(model)
    plan = bnswap.plan(model)
    assert [r.action for r in plan] == ["skip", "swap", "swap"]
    assert "overrides forward" in plan[0].reason
    assert plan[1].adapter_name == "bnswap.layers.batch_norm_forward"
    bnswap.convert(model)
    assert type(model[1]) is BatchNormReLU and type(model[2]) is PlainSubclass
    assert [bnswap.is_swapped(m) for m in model[1:]] == [False, True, True]
    for _ in range(2):
        x = torch.randn(4, 3, 6, 6)
        assert torch.equal(model(x), ref(x)) and state_diff(model, ref) == []
    assert (model[1](torch.randn(4, 4, 3, 3)) >= 0).all()  # its ReLU still applies


def test_sync_batchnorm_without_a_process_group_runs_as_stock():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.BatchNorm2d(4))
    ref = copy.deepcopy(model)
    plan = bnswap.plan(model)
    assert [r.action for r in plan] == ["swap", "swap"]
    bnswap.convert(model)
    assert type(model[1]) is nn.SyncBatchNorm and bnswap.is_swapped(model[1])
    assert type(model[2]) is nn.BatchNorm2d and bnswap.is_swapped(model[2])
    for train in (True, False):  # no process group: SyncBatchNorm runs F.batch_norm
        model.train(train), ref.train(train)
        x = torch.randn(4, 3, 6, 6)
        assert torch.equal(ref(x), model(x))
        assert state_diff(model, ref) == []


# --- direct tests of individual core fixes ----------------------------------------------


@pytest.mark.parametrize(
    "eps,train,track",
    [(0.0, True, True), (-1e-5, True, True), (-1.0, False, True), (0.0, False, False)],
)
def test_non_positive_eps_raises_as_stock(eps, train, track):
    stock, swapped = pair(nn.BatchNorm2d(3, eps=eps, track_running_stats=track).train(train))
    x = torch.randn(2, 3, 4, 4)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    if not bnswap.functional._CHECK_EPS:  # a torch whose F.batch_norm does not check eps
        assert a[0] == b[0] == "ok" and same_tensor(a[1], b[1])
        return
    assert a[0] == "err" and b == a, (a, b)
    assert issubclass(a[1][0], ValueError) and "eps" in a[1][1]
    # stock increments num_batches_tracked before F.batch_norm raises; bnswap raises first
    assert state_diff(stock, swapped) == (["num_batches_tracked"] if train and track else [])


def test_the_eps_probe_matches_this_torch():
    a = outcome(
        lambda: torch.nn.functional.batch_norm(
            torch.randn(4, 2), None, None, training=True, eps=0.0
        )
    )
    assert (a[0] == "err") == bnswap.functional._CHECK_EPS
    # the probe itself, called again (the constant was computed once, at import)
    assert bnswap.functional._stock_checks_eps() is (a[0] == "err")


def test_zero_eps_in_eval_runs_as_stock():
    stock, swapped = pair(nn.BatchNorm2d(3, eps=0.0).eval())
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(stock(x), swapped(x))


@pytest.mark.parametrize("train", [True, False])
def test_zero_channels_raise_stock_index_error(train):
    stock, swapped = pair(nn.BatchNorm2d(0).train(train))
    x = torch.randn(2, 0, 3, 3)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == "err" and a[1][0] is IndexError and b == a, (a, b)


@pytest.mark.parametrize("n", [2, 0])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("missing", ["running_mean", "running_var", "both"])
@pytest.mark.parametrize("train", [True, False])
def test_statistics_set_to_none_behave_as_stock(train, missing, track, n):
    # A layer whose statistics a user set to None (one or both): stock's
    # _BatchNorm.forward decides on batch statistics only when both are None and
    # ATen raises for one missing; bnswap follows it case by case.
    layer = nn.BatchNorm2d(3, track_running_stats=track)
    if not track:
        layer.running_mean, layer.running_var = torch.rand(3), torch.rand(3) + 0.5
    for name in ["running_mean", "running_var"] if missing == "both" else [missing]:
        setattr(layer, name, None)
    stock, swapped = pair(layer.train(train))
    x = torch.randn(n, 3, 4, 4)
    saved = copy.deepcopy(swapped.state_dict())
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    if a[0] != b[0] and TORCH < (2, 8):
        # Only one of them None, with batch statistics: torch >= 2.8 raises this ValueError
        # (pytorch PR 153233); older releases update the one that is left, which the
        # consolidated ops cannot: bnswap raises the newer release's error (README,
        # "torch releases"), before any kernel or counter update.
        assert missing != "both" and train and a[0] == "ok", (a, b)
        assert b[1] == (
            ValueError,
            "running_mean and running_var must either both be None or neither be None",
        )
        assert all(torch.equal(v, saved[k]) for k, v in swapped.state_dict().items())
        return
    assert a[0] == b[0], (a, b)
    if a[0] == "err":
        assert a[1] == b[1]
        nbt_moved = train and track
        assert state_diff(stock, swapped) == (["num_batches_tracked"] if nbt_moved else [])
    else:
        assert torch.equal(a[1], b[1])
        assert state_diff(stock, swapped) == []


NON_FLOATING = [
    torch.long,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("train, track", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("dtype", [*NON_FLOATING, "quint8"], ids=str)
def test_non_floating_input_raises_stocks_exact_error(dtype, train, track):
    """In process (the table above runs in a subprocess): the exception type and message
    are stock's for every non-floating dtype. Guards: bnswap's own table of dtype names
    said 'uint16' where torch says 'UInt16', and 'quint8' where stock names the
    QuantizedCPU backend."""
    stock, swapped = pair(nn.BatchNorm2d(3, track_running_stats=track).train(train))
    if dtype == "quint8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated
            x = torch.quantize_per_tensor(torch.ones(2, 3, 2, 2), 0.1, 0, torch.quint8)
    else:
        x = torch.ones(2, 3, 2, 2, dtype=dtype)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == b[0] == "err" and a[1][0] is b[1][0] and a[1][0] in DTYPE_ERRORS
    assert b[1][1] == a[1][1], (a, b)
    assert [k for k in state_diff(stock, swapped) if k != "num_batches_tracked"] == []
    if track:
        assert int(swapped.num_batches_tracked) == 0  # bnswap raises before counting


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("which", ["weight", "bias", "running_mean", "running_var"])
def test_a_wrong_sized_tensor_is_named_as_stock_names_it(which, train):
    """In process: the message names the tensor whose size is wrong, as ATen's
    _batch_norm_impl_index does ("bias should contain 3 elements not 4"). Guards the
    labels of bnswap's own check, and that it checks the bias at all."""
    stock, swapped = pair(nn.BatchNorm2d(3).train(train))
    for m in (stock, swapped):
        if which in ("weight", "bias"):
            setattr(m, which, nn.Parameter(torch.ones(4)))
        else:
            setattr(m, which, torch.ones(4))
    x = torch.randn(2, 3, 2, 2)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == b[0] == "err" and b[1] == a[1] == (
        RuntimeError,
        f"{which} should contain 3 elements not 4",
    ), (a, b)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("momentum", ["a", [0.1]])
def test_a_momentum_that_is_no_number_raises_stocks_type_error(training, momentum):
    """Guards: a str momentum raised the consolidated op's RuntimeError ("aten::
    _batch_norm_with_update() Expected a value of type 'float' ..."); stock's parser
    raises a TypeError, in eval too. Raised before the batch is counted (deviation 1)."""
    ref = nn.BatchNorm2d(3, momentum=momentum).train(training)
    layer = bnswap.convert(copy.deepcopy(ref))
    x = torch.randn(4, 3, 2, 2)
    with pytest.raises(TypeError) as stock_error:
        ref(x)
    with pytest.raises(TypeError) as ours:
        layer(x)
    assert (
        str(ours.value)
        == str(stock_error.value)
        == (
            f"batch_norm(): argument 'momentum' (position 7) must be float, not "
            f"{type(momentum).__name__}"
        )
    )
    assert int(layer.num_batches_tracked) == 0
    assert torch.equal(layer.running_mean, torch.zeros(3))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("momentum", [np.bool_(True), np.bool_(False), np.complex64(0.5)])
def test_a_momentum_that_torchs_parser_takes_runs_as_stock(training, momentum):
    """Guards the probe that raises stock's error for a momentum that is no number: numpy
    bools and complex scalars are no ``numbers.Real`` yet torch's parser takes them (as
    1.0 / 0.0 / 0.5); the layer then runs as stock, bitwise."""
    ref = nn.BatchNorm2d(3).train(training)
    ref.momentum = momentum
    layer = bnswap.convert(copy.deepcopy(ref))
    x = torch.randn(4, 3, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy's ComplexWarning, for both
        assert torch.equal(layer(x), ref(x))
    assert torch.equal(layer.running_mean, ref.running_mean)
    assert torch.equal(layer.running_var, ref.running_var)
    assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == int(training)
