"""``import bnswap`` patches nothing; the patches of ``bnswap._compat.PATCHES`` are applied
at the first swapped layer (a swap, or an unpickled swapped model), can be turned off
with ``BNSWAP_DISABLE_PATCHES``, and ``docs/patches.md`` lists each (issue 21, item 3).
Fresh interpreters: every case needs a process where bnswap has swapped nothing yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bnswap import _compat
from bnswap._compat._shared import is_patched

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys, torch
orig_script = torch.jit._recursive.create_script_module
def state():
    return {"script_patched": torch.jit._recursive.create_script_module is not orig_script,
            "hooks": [type(f).__name__ for f in sys.meta_path
                      if type(f).__module__.startswith("bnswap")],
            "onnx_imported": "torch.onnx._internal.exporter._fx_passes" in sys.modules,
            "torchao_imported": any(k.startswith("torchao") for k in sys.modules),
            "applied": sorted(__import__("bnswap")._compat.applied())}
"""


def _run(body: str, env: dict | None = None) -> dict:
    code = _PROBE + textwrap.dedent(body)
    e = {k: v for k, v in os.environ.items() if k != _compat.DISABLE_ENV}
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=e
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_patches_nothing_and_first_swap_applies():
    out = _run("""
        import bnswap
        before = state()
        from torch import nn
        bnswap.plan(nn.Sequential(nn.BatchNorm2d(3)))       # a plan swaps nothing
        after_plan = state()
        bnswap.convert(nn.Sequential(nn.BatchNorm2d(3)))
        print(json.dumps([before, after_plan, state()]))
    """)
    before, after_plan, after = out
    assert (
        before
        == after_plan
        == {
            "script_patched": False,
            "hooks": [],
            "onnx_imported": False,
            "torchao_imported": False,
            "applied": [],
        }
    )
    assert after["script_patched"] and after["hooks"] == ["_ImportHook"]
    import torch._decomp

    core_aten = hasattr(torch._decomp, "_core_aten_decompositions_post_autograd")  # gate
    assert after["applied"] == [
        *(["torch._decomp._core_aten_decompositions_post_autograd"] if core_aten else []),
        "torch.jit._recursive.create_script_module",
        "torch.nn.modules.batchnorm._BatchNorm.__getstate__ / __deepcopy__ (added)",
        "torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle",
    ]
    assert not after["onnx_imported"] and not after["torchao_imported"]


def test_unpickled_model_applies_no_patch_and_converts_again(tmp_path):
    """A converted model saved whole loads in a fresh process as stock's layers, applying
    no patch (issue 32: nothing of bnswap's in the checkpoint); bnswap.convert after
    loading swaps it and applies them, and it scripts as stock."""
    path = tmp_path / "m.pt"
    _run(f"""
        import bnswap, torch
        from torch import nn
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
        m(torch.randn(4, 3, 5, 5))
        torch.save(bnswap.convert(m.eval()), {str(path)!r})
        print(json.dumps(1))
    """)
    out = _run(f"""
        import bnswap, torch
        m = torch.load({str(path)!r}, weights_only=False)
        loaded = [state(), bnswap.is_swapped(m[1])]
        bnswap.convert(m)
        x = torch.randn(2, 3, 5, 5)
        err = float((torch.jit.script(m)(x) - m(x)).abs().max())
        print(json.dumps([*loaded, state(), bnswap.is_swapped(m[1]), err]))
    """)
    before, swapped_on_load, after, swapped, err = out
    assert before["applied"] == [] and not swapped_on_load and swapped
    assert "torch.jit._recursive.create_script_module" in after["applied"]
    assert err == 0.0


@pytest.mark.parametrize(
    "value", ["all", "torchscript, TORCHAO,onnx,core_aten,ddp,checkpoints,Dynamo,inductor"]
)
def test_disable_all(value):
    out = _run(
        """
        import bnswap
        from torch import nn
        m = bnswap.convert(nn.Sequential(nn.BatchNorm2d(3)))
        try:
            torch.jit.script(m)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        print(json.dumps([state(), err]))
    """,
        {_compat.DISABLE_ENV: value},
    )
    st, err = out
    assert st["applied"] == [] and not st["script_patched"] and st["hooks"] == []
    # what docs/patches.md says stops working: TorchScript compiles bnswap's dispatcher
    # (the class's forward, once a layer of it is swapped in this process)
    assert err.startswith("RuntimeError: \nundefined value F:") and "bnswap" in err


def test_disable_some_and_unknown_name_warns():
    out = _run(
        """
        import warnings, bnswap
        from torch import nn
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            bnswap.convert(nn.Sequential(nn.BatchNorm2d(3)))
        present = []
        # torchao is optional; torch.onnx's dynamo exporter module is absent in torch 2.4
        for name in ("torchao.quantization.pt2e.quantize_pt2e",
                     "torch.onnx._internal.exporter._fx_passes"):
            try:
                __import__(name)
            except ImportError:
                continue
            present.append(name)
        print(json.dumps([state(), [str(x.message) for x in w], present]))
    """,
        {_compat.DISABLE_ENV: "torchscript,cuda"},
    )
    st, warned, present = out
    assert not st["script_patched"]
    onnx = "torch.onnx._internal.exporter._fx_passes"
    assert (onnx + ".decompose_with_registry" in st["applied"]) == (onnx in present)
    ao = "torchao.quantization.pt2e.quantize_pt2e"
    assert (ao + "._get_node_name_to_scope" in st["applied"]) == (ao in present)
    assert warned == [
        "bnswap: BNSWAP_DISABLE_PATCHES names unknown patches ['cuda']; known: "
        "'all', 'checkpoints', 'core_aten', 'ddp', 'dynamo', 'inductor', 'onnx', 'torchao', "
        "'torchscript'"
    ]


def test_docs_list_every_patch():
    text = (ROOT / "docs" / "patches.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("|")[2].strip().strip("`") for r in rows] == [p.target for p in _compat.PATCHES]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [p.name for p in _compat.PATCHES]


_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def test_the_design_page_counts_the_patches_of_the_table():
    """docs/design.md says how many patches there are, and when they are applied (issue
    46: it said three, applied at ``import bnswap``)."""
    text = " ".join((ROOT / "docs" / "design.md").read_text().split())
    names = {p.name for p in _compat.PATCHES}
    count, named = _WORDS[len(_compat.PATCHES)], _WORDS[len(names)]
    said = f"`bnswap._compat.PATCHES` ({count}, under {named} names"
    assert said in text
    assert "applied at the process's first swap" in text
    assert "applied at `import bnswap`" not in text


def test_torchao_is_patched_in_three_helpers_and_nothing_else():
    """bnswap's torchao patch is one rewrite before torchao reads a graph, in the helper
    each public call reads it with first: prepare's, convert_pt2e's and the train / eval
    switch's. Nothing else of those modules is replaced (no wrapper that puts the
    consolidated ops back into torchao's graphs: they stay stock's)."""
    pytest.importorskip("torchao")
    _compat.install()  # idempotent; torchao's modules are patched as they are imported
    from torchao.quantization.pt2e import export_utils, quantize_pt2e

    wrapped = {
        f"{mod.__name__}.{name}"
        for mod in (quantize_pt2e, export_utils)
        for name, value in vars(mod).items()
        if is_patched(value)
    }
    assert wrapped == {
        "torchao.quantization.pt2e.quantize_pt2e._get_node_name_to_scope",
        "torchao.quantization.pt2e.quantize_pt2e._convert_to_reference_decomposed_fx",
        "torchao.quantization.pt2e.export_utils._replace_batchnorm",
    }
    assert {p.target for p in _compat.PATCHES if p.name == "torchao"} <= wrapped
