"""bnswap.ort's compatibility layer and extension build: version gate, torch's public
behaviour left unchanged, build errors, import isolation. Skipped without ORT training."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import bnswap
import bnswap.ort

if not bnswap.ort.is_available():
    pytest.skip("onnxruntime-training / torch-ort not installed", allow_module_level=True)

pytestmark = pytest.mark.ort

from bnswap.ort import _build, _compat  # noqa: E402


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )


def test_torch_public_behaviour_unchanged_after_ort_training():
    import torch.utils.checkpoint

    seed, ckpt = torch.manual_seed, torch.utils.checkpoint.checkpoint
    export = torch.onnx.export
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    wrapped = bnswap.convert(model, backend="ort")
    wrapped(torch.randn(2, 3, 5, 5)).sum().backward()
    # (torch._dynamo, imported by the export, wraps manual_seed itself: compare unwrapped)
    assert inspect.unwrap(torch.manual_seed) is inspect.unwrap(seed)
    assert torch.manual_seed.__module__ == "torch.random"
    assert inspect.unwrap(torch.utils.checkpoint.checkpoint) is inspect.unwrap(ckpt)
    assert torch.onnx.export is export
    assert inspect.signature(torch.onnx.export).parameters["dynamo"].default is True
    for name in (
        "torch.onnx._internal.jit_utils",
        "torch.onnx._type_utils",
        "torch.onnx._globals",
        "torch.onnx._internal._beartype",
    ):
        assert name not in sys.modules
    import torch.onnx.symbolic_opset9 as shim9

    assert not hasattr(shim9, "_convolution")
    reg = _compat._registry()
    for op in ("aten::_batch_norm_with_update", "aten::_batch_norm_no_update"):
        assert not reg.is_registered_op(op, 17)
    conv = reg._registry.get("aten::convolution")
    assert conv is None or not conv._functions._overrides  # ORT's override is scoped


def test_ort_scope_defaults_torch_onnx_export_to_torchscript_on_its_own_thread_only(tmp_path):
    """Guards: while ORT exported (ort_scope held), torch.onnx.export defaulted to
    dynamo=False in every thread of the process; another thread's export got the
    TorchScript exporter. Only the scope's own thread gets it now. The exporter is told
    by what it returns: the dynamo exporter an ONNXProgram, the TorchScript one None."""
    import threading

    pytest.importorskip("onnxscript")
    m, x = nn.Linear(2, 2).eval(), (torch.randn(1, 2),)
    inside, release = threading.Event(), threading.Event()
    got: dict = {}

    def hold_the_scope():
        with _compat.ort_scope():
            got["owner"] = torch.onnx.export(m, x, str(tmp_path / "owner.onnx"))
            inside.set()
            release.wait(120)

    t = threading.Thread(target=hold_the_scope)
    t.start()
    try:
        assert inside.wait(120)
        got["other"] = torch.onnx.export(m, x, str(tmp_path / "other.onnx"))  # scope held
    finally:
        release.set()
        t.join(120)
    assert got["owner"] is None  # the TorchScript exporter, as ORT needs
    assert type(got["other"]).__name__ == "ONNXProgram"  # torch's default, dynamo=True


def test_plain_torchscript_export_still_standard_onnx(tmp_path):
    bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), backend="ort")
    onnx = pytest.importorskip("onnx")
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(m, (torch.randn(1, 3, 5, 5),), str(path), dynamo=False)
    domains = {n.domain for n in onnx.load(str(path)).graph.node}
    assert domains <= {"", "ai.onnx"}


def test_version_gate(monkeypatch):
    monkeypatch.setattr(_compat, "TESTED_ORT", ("0.0.1",))
    monkeypatch.delenv(_compat.OVERRIDE_ENV, raising=False)
    with pytest.raises(_compat.UnsupportedVersionError, match="BNSWAP_ORT_ALLOW_UNTESTED"):
        _compat.check_versions()
    monkeypatch.setenv(_compat.OVERRIDE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="not tested"):
        _compat.check_versions()


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("BNSWAP_CACHE_DIR", str(tmp_path / "c"))
    d = _build.cache_dir()
    assert d.parent == tmp_path / "c" / "ort-ext"
    assert torch.__version__.replace("+", "_") in d.name
    monkeypatch.delenv("BNSWAP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert _build.cache_dir().parent == tmp_path / "x" / "bnswap" / "ort-ext"


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("BNSWAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-bnswap")
    with pytest.raises(_build.BuildError, match=r"No C\+\+ compiler found.*apt-get install g\+\+"):
        _build.ensure_extension()
    assert not _build.extension_path().exists()


def test_missing_ort_names_install_command(monkeypatch):
    monkeypatch.setattr(bnswap.ort, "is_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install onnxruntime-training-cpu==1.19.2") as e:
        bnswap.ort.wrap(bnswap.convert(nn.Sequential(nn.BatchNorm1d(3))))
    assert "--no-deps torch-ort==1.19.2" in str(e.value)


def test_extension_built_in_cache_not_site_packages():
    _compat.apply()  # loads the extension (also when this test runs alone)
    path = _build.ensure_extension()
    assert path.is_file()
    import onnxruntime

    assert not str(path).startswith(os.path.dirname(onnxruntime.__file__))
    mod = sys.modules.get(f"{_compat._EXT_PKG}.aten_op_executor")
    assert mod is not None and mod.__file__ == str(path)


def test_import_bnswap_does_not_import_ort_and_failed_ort_import_recovers():
    r = _run("""
        import inspect, sys, torch, torch.nn as nn
        import bnswap
        m = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        assert not any(k.startswith("onnxruntime") for k in sys.modules), "ort imported"
        seed = torch.manual_seed
        import onnxruntime.training  # fails inside (swallowed) on torch 2.13: ORT patches torch
        w = bnswap.convert(m, backend="ort")
        w(torch.randn(2, 3, 5, 5)).sum().backward()
        assert inspect.unwrap(torch.manual_seed) is inspect.unwrap(seed), torch.manual_seed
        assert int(m[1].num_batches_tracked) == 1
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_build_cli_info():
    r = subprocess.run(
        [sys.executable, "-m", "bnswap.ort", "info"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "onnxruntime 1.19.2" in r.stdout and "aten_op_executor" in r.stdout


def test_the_extension_build_shows_progress_while_the_compiler_is_silent(capsys):
    """The compile prints nothing for 30 to 90 s: a line on stderr every few seconds."""
    import time

    from bnswap.ort import _build

    t0 = time.monotonic()
    with _build._progress(t0, every=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count(f"bnswap.ort: compiling {_build.EXTENSION}...") >= 3


def test_named_tensor_signatures_gate_matches_the_installed_ortmodule():
    """The remove_duplicate override (issue 19 case 2) is on exactly when the installed
    ORTModule lacks the argument (1.19.2 does), and then has torch's signature."""
    ortmodule = _compat.apply()
    lacks = _compat.lacks_remove_duplicate(ortmodule)
    assert lacks is (
        "remove_duplicate" not in inspect.signature(ortmodule.ORTModule.named_parameters).parameters
    )
    assert lacks  # onnxruntime-training 1.19.2
    cls = bnswap.ort.BNSwapORTModule
    for name in ("named_parameters", "named_buffers"):

        def params(f):
            return [(p.name, p.default) for p in inspect.signature(f).parameters.values()]

        assert params(getattr(cls, name)) == params(getattr(nn.Module, name))
    model = bnswap.convert(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    model.tied = model[0]  # a shared module: remove_duplicate=False lists it twice
    wrapped = bnswap.ort.wrap(model)
    assert list(wrapped.named_parameters(remove_duplicate=False)) == list(
        model.named_parameters(remove_duplicate=False)
    )
    assert list(wrapped.named_buffers(prefix="p")) == list(model.named_buffers(prefix="p"))


@pytest.mark.parametrize("version", [(3, 10, 14), (3, 11, 7), (3, 12, 0), (3, 13, 1), (3, 9, 0)])
def test_check_python_accepts_3_10_and_3_11_only(version):
    if version[:2] in ((3, 10), (3, 11)):
        assert bnswap.ort.check_python(version) is None
        return
    with pytest.raises(
        bnswap.ort.ORTNotAvailableError,
        match=rf"needs Python 3.10 or 3.11 \(this is Python {version[0]}."
        rf"{version[1]}\).*last release.*backend='aten'",
    ):
        bnswap.ort.check_python(version)


def test_backend_ort_on_python_3_12_raises_one_clear_error_and_changes_nothing():
    """Issue 19: onnxruntime-training 1.19.2 has no wheels for Python 3.12+. There,
    convert(backend="ort") and BNSwap(backend="ort").setup raise one error naming the
    Python versions, before the model changes (sys.version_info patched in a child)."""
    p = _run("""
        import collections, sys
        import torch, bnswap, bnswap.ort
        from torch import nn
        from bnswap.lightning import BNSwap
        V = collections.namedtuple("V", "major minor micro releaselevel serial")
        sys.version_info = V(3, 12, 1, "final", 0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        for call in (lambda: bnswap.convert(model, backend="ort"),
                     lambda: BNSwap("ort").setup(None, model, "fit")):
            try:
                call()
            except bnswap.ort.ORTNotAvailableError as err:
                print("ERR", err)
            assert not bnswap.is_swapped(model[1]) and not model._forward_pre_hooks
            assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias",
                "1.running_mean", "1.running_var", "1.num_batches_tracked"]
        print("UNCHANGED")
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    errs = [line for line in p.stdout.splitlines() if line.startswith("ERR")]
    assert len(errs) == 2 and all(
        "needs Python 3.10 or 3.11 (this is Python 3.12)" in e for e in errs
    )
    assert "UNCHANGED" in p.stdout
