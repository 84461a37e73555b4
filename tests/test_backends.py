"""The backend seam (bnswap/backends.py): plan, convert and the callback ask a Backend
object, and a plan with ``wrap="children"`` says which children a wrapping backend wraps
and which layers run eager on aten (what the Lightning callback used to work out itself,
by planning with "aten" and rewriting rows)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

import bnswap
from bnswap.backends import BACKENDS, Backend, backend_named

PKG = pathlib.Path(bnswap.__file__).parent


def test_backend_named_gives_the_objects_and_refuses_other_names_like_convert():
    assert [b.name for b in BACKENDS.values()] == ["aten", "ort"]
    assert backend_named("ort") is BACKENDS["ort"]
    assert backend_named(BACKENDS["aten"]) is BACKENDS["aten"]
    for bad in ("cudnn", None, 3):
        with pytest.raises(ValueError, match=r"unknown backend .*; choose one of 'aten', 'ort'"):
            backend_named(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        bnswap.convert(nn.BatchNorm1d(2), "cudnn")


@pytest.mark.parametrize("module", ["plan.py", "convert.py", "lightning.py"])
def test_the_modules_above_the_seam_compare_no_backend_name(module):
    """Guards the seam: ``backend == "ort"`` branches (12 of them once) crept back into
    plan / convert / the callback instead of asking the Backend object."""
    names = set(BACKENDS)
    found = []
    for node in ast.walk(ast.parse((PKG / module).read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in names:
                    found.append(f"{module}:{node.lineno}")
    assert not found


class _Model(nn.Module):
    """A LightningModule's shape: children, one of them with an excluded layer, one with a
    lazy layer, one with a SyncBatchNorm, one without BatchNorm."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
        self.side = nn.Sequential(nn.BatchNorm2d(2), nn.BatchNorm2d(2))
        self.lazy = nn.Sequential(nn.LazyBatchNorm1d())
        self.synced = nn.Sequential(nn.SyncBatchNorm(2))
        self.plain = nn.Linear(2, 2)


def test_plan_wrap_children_places_each_row_where_it_runs():
    model = _Model()
    p = bnswap.plan(model, "ort", exclude="side.1", wrap="children")
    assert p.to_wrap == ("net",) and p.wrap == "children"
    rows = {r.name: r for r in p}
    assert list(rows) == ["net.1", "side.0", "side.1", "lazy.0", "synced.0"]  # model order
    assert (rows["net.1"].backend, rows["net.1"].kernel) == ("ort", "BatchNormInternal (ORT)")
    assert (rows["side.0"].backend, rows["side.0"].kernel) == ("aten", "Native")
    assert rows["side.0"].reason.endswith(
        "eager: its top-level module holds a layer that is not swapped"
    )
    assert rows["side.1"].action == "skip" and rows["side.1"].backend == "-"
    assert rows["lazy.0"].backend == "aten" and "lazy layer" in rows["lazy.0"].reason
    # ONNX Runtime cannot synchronize: the child runs eager, synchronized on aten
    synced = rows["synced.0"]
    assert (synced.action, synced.backend, synced.adapter_name) == (
        "swap",
        "aten",
        "bnswap.sync.sync_batch_norm_forward",
    )
    assert "eager, synchronized on aten" in synced.reason
    # the whole-model plan refuses the SyncBatchNorm instead (convert raises)
    whole = {r.name: r for r in bnswap.plan(model, "ort", exclude="side.1")}
    assert (
        whole["synced.0"].action == "skip" and "UnsupportedLayerError" in whole["synced.0"].reason
    )
    assert all(r.backend in ("ort", "-") for r in whole.values())
    # aten ignores the scope: nothing is wrapped, nothing rewritten
    aten = bnswap.plan(model, exclude="side.1", wrap="children")
    assert aten.to_wrap == () and [r.reason for r in aten] == [
        r.reason for r in bnswap.plan(model, exclude="side.1")
    ]
    with pytest.raises(ValueError, match="unknown wrap 'child'; choose one of 'model', 'children'"):
        bnswap.plan(model, "ort", wrap="child")


def test_plan_row_placement_holds_the_eager_note_as_a_field():
    """Guards the structured field: the Lightning callback found an eager child's note by
    searching the reason for "eager". Each of the three notes ``wrap="children"`` gives is
    ``row.placement`` (the reason ends with it, as before: the reasons below are the texts
    the plan gave); None for a row that runs where the plan's backend puts it, a skipped
    row, a plan without children placement, and a model that is itself a layer."""
    eager = "eager: its top-level module holds a layer that is not swapped"
    lazy = "eager until a forward initializes its top-level module's lazy layer (then wrapped)"
    synced = (
        "eager, synchronized on aten: its top-level module holds a SyncBatchNorm "
        "(ONNX Runtime cannot synchronize batch statistics across processes)"
    )
    skip_note = (
        "; ORT cannot run an unswapped BatchNorm: bnswap.convert(..., "
        "backend='ort') refuses the model, BNSwap keeps its child eager"
    )
    p = bnswap.plan(_Model(), "ort", exclude="side.1", wrap="children")
    assert [(r.name, r.backend, r.placement, r.reason) for r in p] == [
        ("net.1", "ort", None, "-"),
        ("side.0", "aten", eager, eager),
        ("side.1", "-", None, "excluded by 'side.1'" + skip_note),
        (
            "lazy.0",
            "aten",
            lazy,
            "uninitialized LazyBatchNorm1d: swapped now, keeps the "
            "swap when it initializes; " + lazy,
        ),
        ("synced.0", "aten", synced, synced),
    ]
    # the table and the JSON keep the note in the reason only
    assert [d["reason"] for d in p.to_dicts()] == [r.reason for r in p]
    assert all("placement" not in d for d in p.to_dicts())
    side = str(p).splitlines()[4]  # (after the summary, the header and the rule)
    assert side.startswith("side.0") and side.endswith(eager)
    for other in (
        bnswap.plan(_Model(), "ort", exclude="side.1"),  # wraps the whole model
        bnswap.plan(_Model(), exclude="side.1", wrap="children"),  # aten
        bnswap.plan(nn.BatchNorm2d(2), "ort", wrap="children"),
    ):  # a layer itself
        assert [r.placement for r in other] == [None] * len(other)
    root = bnswap.plan(nn.BatchNorm2d(2), "ort", wrap="children")[0]
    assert (root.backend, root.reason) == ("aten", "-")


def _ort_available() -> bool:
    import bnswap.ort

    return bnswap.ort.is_available()


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_plan_wrap_children_apply_wraps_in_place_atomically_and_runs_like_stock():
    import bnswap.ort

    torch.manual_seed(0)
    model = _Model()
    stock = _Model()
    stock.load_state_dict(model.state_dict())
    p = bnswap.plan(model, "ort", exclude="side.1", wrap="children")
    assert p.apply() is model
    assert isinstance(model.net, bnswap.ort.BNSwapORTModule) and model.net.module[1] is not None
    assert type(model.side) is nn.Sequential and bnswap.is_swapped(model.side[0])
    x = torch.randn(4, 1, 3, 3)
    torch.testing.assert_close(model.net(x), stock.net(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.net.module[1].running_var, stock.net[1].running_var)
    # atomic: a child that cannot be wrapped undoes the swaps and the wraps before it
    fresh = _Model()
    fresh.lazy = nn.Sequential(nn.BatchNorm1d(2))
    fresh.side[1].double()  # float64: ORT refuses it
    q = bnswap.plan(fresh, "ort", include=["net.*", "side.*", "lazy.*"], wrap="children")
    assert q.to_wrap == ("net", "side", "lazy")
    with pytest.raises(bnswap.ort.UnsupportedLayerError, match="float64"):
        q.apply()
    assert type(fresh.net) is nn.Sequential and type(fresh.side) is nn.Sequential
    assert not any(bnswap.is_swapped(m) for m in fresh.modules())


class _Plain(Backend):
    """A backend that is neither of bnswap's: what plan asks of one."""

    name = "plain"
    kernel = "Plain kernel"


def test_a_registered_backend_object_answers_every_question_plan_and_convert_ask():
    BACKENDS["plain"] = _Plain()
    try:
        model = nn.Sequential(nn.BatchNorm2d(3))
        p = bnswap.plan(model, "plain")
        assert (p.backend, p[0].backend, p[0].kernel) == ("plain", "plain", "Plain kernel")
        assert bnswap.convert(model, "plain") is model  # wraps nothing: the model itself
        assert bnswap.is_swapped(model[0])
    finally:
        del BACKENDS["plain"]


def test_a_plan_convert_would_refuse_says_so_in_its_summary():
    """Guards: plan(model, "ort") of a model with a layer bnswap skips said "3 of 4
    swapped" while convert(backend="ort") refuses the whole model (ORT cannot run a
    skipped layer), so nothing changes."""
    model = nn.Sequential(nn.BatchNorm2d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2))
    p = bnswap.plan(model, "ort", exclude="1")
    assert p.refused
    assert p.summary() == (
        "bnswap plan: 1 of 3 BatchNorm layers would be swapped, 2 skipped; convert(backend='ort') "
        "refuses this model (ONNX Runtime cannot run a skipped layer): nothing would change"
    )
    assert str(p).splitlines()[0] == p.summary()
    for fine in (
        bnswap.plan(model, exclude="1"),  # aten runs skipped layers as stock
        bnswap.plan(model, "ort", exclude="1", wrap="children"),  # children eager
        bnswap.plan(nn.Sequential(nn.BatchNorm2d(2)), "ort"),
    ):  # nothing skipped
        assert not fine.refused and "refuses" not in fine.summary()
    with pytest.raises(
        bnswap.ort.UnsupportedLayerError,
        match=r"'2' is a SyncBatchNorm.*bnswap.ort.wrap only submodules",
    ):
        bnswap.convert(model, "ort", exclude="1")
    assert not any(bnswap.is_swapped(m) for m in model)
    # an uninitialized lazy layer: swapped (no skip), but ORT cannot export it yet
    lazy = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d())
    p = bnswap.plan(lazy, "ort")
    assert (
        p.refused
        and not p.skipped
        and p.summary().endswith(
            "refuses this model (ONNX Runtime cannot run an uninitialized lazy layer: run one "
            "forward first): nothing would change"
        )
    )
    assert not bnswap.plan(lazy).refused  # aten: it keeps its swap when it initializes
    # convert names every layer ORT cannot run (it named the first, as bnswap.ort.wrap,
    # with five possible causes), before anything changes
    three = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    with pytest.raises(
        bnswap.ort.UnsupportedLayerError,
        match=r"^bnswap.convert: backend='ort' refuses this model: ONNX Runtime "
        r"cannot run a BatchNorm layer that is not a bnswap layer: '1' "
        r"\(excluded by '1'\), '2' \(excluded by '2'\)\. ",
    ):
        bnswap.convert(three, "ort", exclude=["1", "2"])
    with pytest.raises(
        bnswap.ort.UnsupportedLayerError,
        match=r"'1' is an uninitialized LazyBatchNorm1d. To use it, run one "
        "forward of the model first",
    ):
        bnswap.convert(lazy, "ort")
    assert not any(bnswap.is_swapped(m) for m in [*three, *lazy])
