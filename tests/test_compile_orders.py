"""torch.compile and bnswap's dispatcher, in every order (fresh interpreters).

A swap puts bnswap's dispatcher in the BatchNorm class's ``forward`` at the process's
first swap (``bnswap._swap.dispatch_on``). Guarded here, each order in its own fresh
interpreter (``tests/compile_orders.py``), against a process where bnswap was never
imported:

* a swapped model's compiled graph runs the consolidated ops whatever came first: a
  compile of the same model or of another one before the first swap (their cached code
  is invalidated, with one warning naming the fix), ``Module.compile()``, ``revert`` and
  ``convert`` again, ``torch._dynamo.reset()``;
* a model bnswap never touched compiles exactly as without bnswap: the same graphs (the
  AOT graphs' code, for ``aot_eager``), frames, outputs, gradients and running
  statistics, bit for bit; torch's own modules compiled whole (``nn.Sequential(...)
  .compile()``, ``nn.BatchNorm2d(...).compile()``) still compile no frame at all.

Also: inductor's eval conv-BN pass folds swapped layers as it folds stock's, and a
patch of ``torch.nn.functional.batch_norm`` reaches stock layers only, in every mode.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from _helpers import ROOT, TORCH, run_script
from torch import nn

import bnswap

SCRIPT = os.path.join(ROOT, "tests", "compile_orders.py")

#: The batch-norm ops of the graphs that ran, per backend: (stock's, bnswap's).
OPS = {
    "aot_eager": (
        ["_native_batch_norm_legit_functional", "native_batch_norm_backward"],
        ["_batch_norm_with_update_functional", "batch_norm_backward"],
    ),
    # the graph dynamo hands inductor (inductor decomposes both into the same kernels)
    "inductor": (["F.batch_norm"], ["_batch_norm_with_update"]),
}


@functools.cache
def run(order: str, backend: str, disable: str = "") -> tuple[list[dict], list[dict]]:
    """(steps, warnings) of ``compile_orders.py ORDER BACKEND`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["BNSWAP_DISABLE_PATCHES"] = disable
    proc = subprocess.run(
        [sys.executable, SCRIPT, order, backend],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "step" in x], [x for x in lines if "warning" in x]


def _same_bits(got: dict, ref: dict, stats: bool = True) -> None:
    keys = ("out", "grads", "stats") if stats else ("out", "grads")
    assert {k: got[k] for k in keys} == {k: ref[k] for k in keys}, (got, ref)


BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_bnswap_never_touched_compiles_as_without_bnswap(backend):
    """Compiled beside a swapped model, a stock model's graphs (their code, for
    aot_eager), frame count, outputs, gradients and running statistics are those of a
    process where bnswap was never imported."""
    ref, _ = run("stock", backend)
    got, warned = run("user_after_swap", backend)
    stock_ops, _ = OPS[backend]
    assert [s["ran"] for s in got] == [stock_ops, stock_ops]
    assert [s["graphs"] for s in got] == [s["graphs"] for s in ref]
    if backend == "aot_eager":
        assert [s["code"] for s in got] == [s["code"] for s in ref]
    for g, r in zip(got, ref, strict=True):
        _same_bits(g, r)
    assert warned == []  # nothing was compiled before the swap


def test_torchs_own_modules_compiled_whole_still_compile_no_frame():
    """``nn.Sequential(...).compile()`` and ``nn.BatchNorm2d(...).compile()`` after a swap:
    the same frames, graphs and bits as without bnswap. On torch 2.13 dynamo skips
    torch.nn's frames (no frame at all), and the dispatcher's too (bnswap's ``dynamo``
    patch); torch 2.14 compiles such modules whole, the dispatcher inlined."""
    ref, _ = run("neighbours", "aot_eager")
    got, _ = run("neighbours_after_swap", "aot_eager")
    if TORCH <= (2, 13):  # torch 2.14 compiles torch's own modules whole: frames either way
        assert [s["graphs"] for s in ref] == [0, 0, 0]
    assert got == ref


def test_without_the_dynamo_patch_the_dispatcher_would_be_compiled():
    """The control for the test above: with the ``dynamo`` patch off, dynamo compiles the
    dispatcher's frame for torch's own modules (what the patch prevents)."""
    ref, _ = run("neighbours", "aot_eager")
    if ref[-1]["graphs"] != 0:
        pytest.skip("this torch compiles torch's own modules whole: no frame to keep skipped")
    got, _ = run("neighbours_after_swap", "aot_eager", disable="dynamo")
    assert got[-1]["graphs"] > 0


@pytest.mark.parametrize(
    "order",
    [
        "compiled_then_converted",
        "neighbour_compiled_then_new_converted",
        "module_compile_then_converted",
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_code_compiled_before_the_first_swap_recompiles_on_bnswap_ops(order, backend):
    """Compiled before the process's first swap (this model, ``Module.compile()``, or
    another model of the same structure): after ``convert``, the swapped model's graph
    runs the consolidated ops (dynamo's cached code was invalidated: one warning says
    so and names the fix), and a stock model compiled before runs stock's again."""
    if backend == "inductor" and order != "neighbour_compiled_then_new_converted":
        pytest.skip("one inductor order (each compile costs ~20 s on 2 cores)")
    ref, _ = run("stock", backend)
    got, warned = run(order, backend)
    stock_ops, bnswap_ops = OPS[backend]
    steps = {s["step"]: s for s in got}
    assert steps["stock"]["ran"] == stock_ops
    assert steps["converted"]["ran"] == bnswap_ops
    if "stock again" in steps:
        assert steps["stock again"]["ran"] == stock_ops
    for s in got:
        _same_bits(s, ref[0], stats=False)  # every step's output and gradients
    assert len(warned) == 1, warned
    message = warned[0]["warning"]
    assert warned[0]["category"] == "RuntimeWarning"
    assert "_BatchNorm.forward changed" in message
    assert "compiled 1 frame(s)" in message
    assert "Convert models before compiling anything" in message


def test_revert_convert_and_reset_each_run_the_right_graph():
    """After the first swap, dynamo's guards see the mark: ``revert`` recompiles onto
    stock's ops, ``convert`` again reuses bnswap's graph, ``torch._dynamo.reset()``
    recompiles on bnswap's; outputs and gradients bitwise stock's throughout."""
    ref, _ = run("stock", "aot_eager")
    got, warned = run("converted_reverted_reset", "aot_eager")
    stock_ops, bnswap_ops = OPS["aot_eager"]
    assert [(s["step"], s["ran"]) for s in got] == [
        ("converted", bnswap_ops),
        ("reverted", stock_ops),
        ("converted again", bnswap_ops),
        ("after reset", bnswap_ops),
    ]
    _same_bits(got[0], ref[0])
    _same_bits(got[1], ref[1])
    for s in got:
        _same_bits(s, ref[0], stats=False)
    assert warned == []


# ----------------------------------------------------------- inductor's eval conv-BN pass
EVAL_CONV_BN = """
import copy, json, torch, torch._functorch.config
from torch import nn
import torch._inductor.config as config
from torch._dynamo.utils import counters
config.efficient_conv_bn_eval_fx_passes = True
# no cache: a cache hit skips the passes (and their counter)
config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
torch.manual_seed(0)
torch.set_num_threads(1)
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, bias=False), nn.BatchNorm2d(8, affine=False)
    def forward(self, x):
        return self.b2(self.c2(torch.relu(self.b1(self.c1(x))))).relu()
stock = M()
with torch.no_grad():
    for b in (stock.b1, stock.b2):
        b.running_mean.uniform_(-1, 1)
        b.running_var.uniform_(0.5, 2)
stock.eval()  # eval layers, trained parameters: the pass's case
swapped = copy.deepcopy(stock)
x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
def run(model):
    counters.clear()
    saved = []
    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(model)(x)
    out.sum().backward()
    return (out.detach(), [p.grad for p in model.parameters()],
            counters["inductor"]["efficient_conv_bn_eval"], sum(saved))
o1, g1, n1, m1 = run(stock)  # before bnswap is imported: stock's reference
import bnswap
bnswap.convert(swapped)
o2, g2, n2, m2 = run(swapped)
print(json.dumps({"pairs": [n1, n2], "saved_bytes": [m1, m2], "out": torch.equal(o1, o2),
                  "grads": all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("disable", ["", "inductor"])
def test_inductors_eval_conv_bn_pass_folds_swapped_layers_as_stocks(disable):
    """``efficient_conv_bn_eval_fx_passes``: stock's two eval conv-BN pairs (affine and
    affine=False) are folded, and so are the swapped copy's (bnswap's ``inductor``
    patch): the same count, the same bytes saved for backward, bitwise outputs and
    gradients. With the patch off (the control) nothing of bnswap's is folded."""
    # the variable is read at the first swap, after the stock reference ran
    code = f"import os\nos.environ['BNSWAP_DISABLE_PATCHES'] = {disable!r}\n" + EVAL_CONV_BN
    rc, out, err = run_script(code, timeout=400)
    assert rc == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    if disable:
        assert got["pairs"] == [2, 0]
        assert got["saved_bytes"][1] > got["saved_bytes"][0]
    else:
        assert got == {
            "pairs": [2, 2],
            "saved_bytes": [got["saved_bytes"][0]] * 2,
            "out": True,
            "grads": True,
        }


# ------------------------------------------------------ a user's patch of F.batch_norm
def test_a_patch_of_functional_batch_norm_reaches_stock_layers_only_in_every_mode(monkeypatch):
    """One rule: bnswap's layers never call ``torch.nn.functional.batch_norm``, in eager
    or under ``torch.func`` (where they run the op it ends in, ``torch.batch_norm``, with
    its arguments); stock layers call it in both. The supported switch for the kernel
    is ``torch.backends.cudnn.flags(enabled=False)`` (docs/kernels.md)."""
    calls: list[int] = []
    original = torch.nn.functional.batch_norm

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "batch_norm", spy)
    torch.manual_seed(0)
    stock = nn.BatchNorm1d(3).eval()
    with torch.no_grad():
        stock.running_var.uniform_(0.5, 2)
    swapped = bnswap.convert(copy.deepcopy(stock))
    x = torch.randn(5, 3)

    def modes(m):
        counts, outs = [], []
        for fn in (
            lambda: m(x),
            lambda: torch.func.functional_call(m, dict(m.named_parameters()), (x,)),
            lambda: torch.func.vmap(m, in_dims=0)(x.unsqueeze(1).expand(5, 2, 3)),
            lambda: torch.func.grad(
                lambda w: torch.func.functional_call(m, {"weight": w}, (x,)).sum()
            )(m.weight),
        ):
            calls.clear()
            outs.append(fn())
            counts.append(len(calls))
        return counts, outs

    stock_counts, stock_outs = modes(stock)
    bnswap_counts, bnswap_outs = modes(swapped)
    assert stock_counts == [1, 1, 1, 1]
    assert bnswap_counts == [0, 0, 0, 0]
    for a, b in zip(stock_outs, bnswap_outs, strict=True):
        assert torch.equal(a, b)
