"""The plan's kernel columns against torch's rule, flow by flow and layer kind by layer
kind (issue 45's table): what ``bnswap.plan(..., device="cuda")`` predicts for stock's
and bnswap's layers and graphs, training on a CUDA device with cuDNN on.

``TABLE`` is the reference everywhere: each cell is ``C`` (``Cudnn``: an op that selects
at run time, torch's rule holds), ``n`` (``Native``: selects at run time, the rule
fails) or ``N`` (``Native``: an op bound to the native kernel). The graphs are captured
on the CPU here; each node's row says what it runs on CUDA (``kernel_before``), and for
stock's nodes what it runs once converted (``kernel``).

Where torch is a CUDA build with cuDNN (``.venv-zoo``: 2.14.1+cu130, no GPU needed),
torch itself answers too, case by case: each batch-norm node (and each layer) runs on
fake ``cuda:0`` tensors under ``FakeTensorMode``, where ``aten.batch_norm`` dispatches
the kernel op ``_batch_norm_impl_index`` chose (``aten.cudnn_batch_norm`` /
``native_batch_norm``), the consolidated ops and ``batch_norm_backward`` are asked
``torch._C._select_batch_norm_backend`` with their arguments (what their CUDA kernels
and torch's own decomposition do), and the ops bound to the native kernel are read from
torch's ``native_functions.yaml`` (their CUDA kernels are the native ones).
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bnswap
from bnswap import _node_kernels, kernels

aten = torch.ops.aten
RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
OLD_EXPORT = kernels.stock_export_op() != "aten.batch_norm.default"  # torch 2.4


def _fake_cuda_answers() -> bool:
    """Whether torch's own selection can be asked on fake CUDA tensors here: a CUDA build
    with cuDNN whose FakeTensorMode runs a CUDA batch norm without a driver (torch 2.14
    does; torch 2.4.1's aborts the process, so a child interpreter asks)."""
    if not (torch.version.cuda and torch.backends.cudnn.is_available()):
        return False
    probe = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "with FakeTensorMode():\n"
        "    bn = torch.nn.BatchNorm2d(2, device='cuda')\n"
        "    bn(torch.empty(2, 2, 2, 2, device='cuda'))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
    return run.returncode == 0


#: torch's own selection can be asked on fake CUDA tensors (a CUDA build with cuDNN)
TORCH_ANSWERS = _fake_cuda_answers()
SUFFIX = "" if torch.cuda.is_available() else kernels.PREDICTED
KERNEL = {"C": "Cudnn" + SUFFIX, "n": "Native" + SUFFIX, "N": "Native"}

# ----------------------------------------------------------------------------- table
#: layer kind -> (class, its keyword arguments, the input's shape and dtype)
KINDS = {
    "float32": (nn.BatchNorm2d, {}, (4, 4, 3, 3), torch.float32),
    "affine_false": (nn.BatchNorm2d, {"affine": False}, (4, 4, 3, 3), torch.float32),
    "no_stats": (nn.BatchNorm2d, {"track_running_stats": False}, (4, 4, 3, 3), torch.float32),
    "n_c": (nn.BatchNorm1d, {}, (4, 4), torch.float32),  # (N, C) input
    "half": (nn.BatchNorm2d, {"dtype": torch.float16}, (4, 4, 3, 3), torch.float16),
    "bfloat16": (nn.BatchNorm2d, {"dtype": torch.bfloat16}, (4, 4, 3, 3), torch.bfloat16),
}
#: flow -> kind -> (stock, bnswap): the kernel each forward batch-norm node (a layer,
#: for eager) runs in training on CUDA, as issue 45's table has it. Eager's bnswap cell:
#: "training/eval" (a swapped layer in eval calls stock's op with its own weight).
_T = {
    #              eager          export      aot         decomp({})  decomp()
    "float32": (("C", "C/C"), ("C", "C"), ("N", "C"), ("N", "C"), ("N", "N")),
    "affine_false": (("n", "C/n"), ("n", "C"), ("N", "C"), ("N", "C"), ("N", "N")),
    "no_stats": (("C", "C/C"), ("C", "C"), ("N", "C"), ("N", "C"), ("N", "N")),
    "n_c": (("n", "n/n"), ("n", "n"), ("N", "n"), ("N", "n"), ("N", "N")),
    "half": (("n", "n/n"), ("n", "n"), ("N", "n"), ("N", "n"), ("N", "N")),
    "bfloat16": (("n", "n/n"), ("n", "n"), ("N", "n"), ("N", "n"), ("N", "N")),
}
FLOWS = ("eager", "export", "aot_eager", "training_ir", "core_aten")
TABLE = {flow: {kind: cells[i] for kind, cells in _T.items()} for i, flow in enumerate(FLOWS)}
if OLD_EXPORT:  # torch 2.4: export records _native_batch_norm_legit_functional (native);
    # its run_decompositions() leaves bnswap's consolidated op (no core-ATen rewrite)
    for kind in KINDS:
        TABLE["export"][kind] = ("N", TABLE["export"][kind][1])
        TABLE["core_aten"][kind] = ("N", TABLE["training_ir"][kind][1])


def converted(kind: str) -> str:
    """What a stock node runs once ``bnswap.convert`` made it a consolidated op: a
    swapped layer's training kernel (stand-ins for a missing weight / bias)."""
    return TABLE["eager"][kind][1].split("/")[0]


# -------------------------------------------------------------------------- captures
def layer(kind: str, swapped: bool) -> tuple[nn.Module, torch.Tensor]:
    cls, kw, shape, dtype = KINDS[kind]
    torch.manual_seed(0)
    m = nn.Sequential(cls(4, **kw))
    x = torch.randn(shape).to(dtype)
    return (bnswap.convert(m) if swapped else m), x


def export_graph(kind: str, swapped: bool) -> torch.fx.GraphModule:
    m, x = layer(kind, swapped)
    return torch.export.export(m, (x,)).module()


def training_ir_graph(kind: str, swapped: bool) -> torch.export.ExportedProgram:
    m, x = layer(kind, swapped)
    return torch.export.export(m, (x,)).run_decompositions({})


def core_aten_graph(kind: str, swapped: bool) -> torch.export.ExportedProgram:
    m, x = layer(kind, swapped)
    return torch.export.export(m, (x,)).run_decompositions()


def aot_graphs(kind: str, swapped: bool) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd hands its compiler (aot_eager's)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    m, x = layer(kind, swapped)
    x.requires_grad_(True)  # (a backward graph for a layer without parameters too)
    torch._dynamo.reset()
    try:
        out = torch.compile(m, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(x)
        out.float().sum().backward()
    finally:
        torch._dynamo.reset()
    return graphs


CAPTURE = {"export": export_graph, "training_ir": training_ir_graph, "core_aten": core_aten_graph}


def forward_rows(p) -> list:
    return [r for r in p if "backward" not in r.op]


def _graph(program) -> torch.fx.GraphModule:
    return program.graph_module if isinstance(program, torch.export.ExportedProgram) else program


# ------------------------------------------------------------- torch's own answer
class _FirstKernelOp(TorchDispatchMode):
    """The kernel op ``aten.batch_norm`` dispatches (CompositeImplicitAutograd: modes see
    what ``_batch_norm_impl_index`` chose), and the consolidated ops' own answer."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        answer = _leaf_answer(func, args)
        if answer is not None:
            self.answers.append(answer)
            with torch.backends.cudnn.flags(enabled=False):  # (fake mode's decomposition
                return func(*args, **(kwargs or {}))  # asks a driver for cuDNN's reserve)
        return func(*args, **(kwargs or {}))


def _select(x, w, b, mean, var, eps) -> str:
    """torch._C._select_batch_norm_backend in training; its binding takes no undefined
    tensor, and torch's rule refuses an undefined weight / bias before anything else."""
    if w is None or b is None:
        return "Native"
    if mean is None and var is None:  # neither, in training: as both, for the rule
        mean = var = w
    return torch._C._select_batch_norm_backend(x, w, b, mean, var, True, float(eps)).name


_KERNEL_OPS = {
    aten.cudnn_batch_norm: "Cudnn",
    aten.miopen_batch_norm: "Miopen",
    **dict.fromkeys(kernels.NATIVE_OPS, "Native"),
}


def _leaf_answer(func, args) -> str | None:
    packet = func.overloadpacket
    if packet in _KERNEL_OPS:
        return _KERNEL_OPS[packet]
    if packet in (aten._batch_norm_with_update, aten._batch_norm_with_update_functional):
        return _select(*args[:5], args[6])
    if packet is aten.batch_norm_backward:  # its kernel's dummy bias: at::empty(1)
        return _select(args[1], args[2], torch.empty(1), args[3], args[4], args[8])
    if packet is aten._batch_norm_no_update:  # issue 44: a CPU kernel only
        return "CPU only (no CUDA kernel)"
    return None


def _fake_cuda(value, fake):
    if isinstance(value, torch.Tensor):
        with fake:
            return torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device="cuda"
            )
    if isinstance(value, (list, tuple)):
        return type(value)(_fake_cuda(v, fake) for v in value)
    return value


def _answer(target, args, kwargs, fake) -> str:
    args, kwargs = _fake_cuda(args, fake), _fake_cuda(kwargs, fake)
    with fake, _FirstKernelOp() as seen:
        target(*args, **kwargs)
    return seen.answers[0]


def _is_batch_norm(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "batch_norm" in str(node.target)


def torch_answers(program, inputs: tuple | None = None) -> list[str]:
    """torch's kernel for each batch-norm node of ``program`` (graph order), its
    arguments as fake ``cuda:0`` tensors of the node's shapes and dtypes: those of its
    arguments' metadata, or with ``inputs``, of the values a run on them passes (a pt2e
    graph's rewritten nodes carry the metadata of torchao's pattern)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = _graph(program)
    fake = FakeTensorMode()
    if inputs is not None:
        out: list[str] = []

        class Seen(torch.fx.Interpreter):
            def run_node(self, node):
                if _is_batch_norm(node):
                    args, kwargs = self.fetch_args_kwargs_from_env(node)
                    out.append(_answer(node.target, args, kwargs, fake))
                return super().run_node(node)

        Seen(gm).run(*inputs)
        return out
    value = _node_kernels._tensor_of
    return [
        _answer(
            node.target,
            torch.fx.node.map_arg(node.args, value),
            torch.fx.node.map_arg(node.kwargs, value),
            fake,
        )
        for node in gm.graph.nodes
        if _is_batch_norm(node)
    ]


def torch_layer_answer(kind: str, swapped: bool, training: bool) -> str:
    """torch's kernel for the layer of ``kind`` (stock's or swapped) on fake CUDA."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cls, kw, shape, dtype = KINDS[kind]
    with FakeTensorMode():
        m = cls(4, device="cuda", **kw)
        if swapped:
            m = bnswap.convert(m)
        m.train(training)
        x = torch.empty(shape, device="cuda", dtype=dtype)
        with _FirstKernelOp() as seen:
            m(x)
    return seen.answers[0]


def _plain(kernel: str) -> str:
    return kernel.removesuffix(kernels.PREDICTED)


# ----------------------------------------------------------------------------- tests
@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("kind", list(KINDS))
def test_eager(kind):
    """Layers: the swapped layer's row (training; eval where it differs) and stock's
    layer by the same rule."""
    stock, ours = TABLE["eager"][kind]
    train, evaluation = ours.split("/")
    m, _ = layer(kind, swapped=False)
    bn = m[0]
    want = KERNEL[train] + ("" if evaluation == train else "; eval " + _plain(KERNEL[evaluation]))
    row = bnswap.plan(m, device="cuda")[0]
    if kind == "n_c":  # a BatchNorm1d names both ranks; this kind is fed (N, C)
        assert row.kernel.endswith("Native for (N, C)")
        got_stock = kernels.op_kernel(
            *kernels.layer_call(bn, training=True, swapped=False, rank=2), "cuda"
        )
        got_ours = [
            kernels.op_kernel(*kernels.layer_call(bn, training=t, rank=2), "cuda")
            for t in (True, False)
        ]
        assert got_ours == [KERNEL[train], KERNEL[evaluation]]
    else:
        assert row.kernel == want
        got_stock = kernels.layer_kernel(bn, "cuda", swapped=False, training=True)
    assert got_stock == KERNEL[stock]
    if TORCH_ANSWERS:
        assert torch_layer_answer(kind, False, True) == _plain(KERNEL[stock])
        assert torch_layer_answer(kind, True, True) == _plain(KERNEL[train])
        assert torch_layer_answer(kind, True, False) == _plain(KERNEL[evaluation])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("flow", ["export", "training_ir", "core_aten"])
def test_programs(flow, kind):
    """torch.export then ep.module(), run_decompositions({}), run_decompositions(): each
    node's kernel now, for stock's and bnswap's graph, and stock's once converted."""
    stock_cell, ours_cell = TABLE[flow][kind]
    for swapped, cell in ((False, stock_cell), (True, ours_cell)):
        program = CAPTURE[flow](kind, swapped)
        p = bnswap.plan(program, device="cuda")
        rows = forward_rows(p)
        assert len(rows) == 1, [r.op for r in p]
        assert rows[0].kernel_before == KERNEL[cell], (swapped, rows[0].op)
        if not swapped and rows[0].action == "swap" and rows[0].node.args[5] is True:
            assert rows[0].kernel == KERNEL[converted(kind)], rows[0].becomes
        if TORCH_ANSWERS:
            answers = torch_answers(program)
            assert [_plain(r.kernel_before) for r in p] == answers
            if not swapped:
                after = [_plain(r.kernel) for r in p if r.action == "swap"]
                assert after == torch_answers(bnswap.convert(program))  # (a GraphModule:
                # rewritten in place, so the rows were read before)


@pytest.mark.parametrize("kind", list(KINDS))
def test_aot_graphs(kind):
    """aot_eager: AOTAutograd's forward and backward graphs."""
    stock_cell, ours_cell = TABLE["aot_eager"][kind]
    for swapped, cell in ((False, stock_cell), (True, ours_cell)):
        fw, bw = aot_graphs(kind, swapped)
        for gm in (fw, bw):
            p = bnswap.plan(gm, device="cuda")
            assert [_plain(r.kernel_before) for r in p] == [_plain(KERNEL[cell])], [r.op for r in p]
            assert p[0].kernel_before == KERNEL[cell]
            if TORCH_ANSWERS:
                assert [_plain(r.kernel_before) for r in p] == torch_answers(gm)
        (row,) = bnswap.plan(fw, device="cuda")
        if not swapped:  # the forward node, converted
            assert row.kernel == KERNEL[converted(kind)]


def test_pt2e_qat_prepared_graph():
    """pt2e QAT: the prepared graph's batch-norm node (a Conv2d -> BatchNorm2d pair)
    runs what stock's exported node runs; bnswap's, a swapped layer's."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    x = torch.randn(2, 3, 6, 6)
    for swapped in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        m = bnswap.convert(m) if swapped else m
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
        prepared = prepare_qat_pt2e(torch.export.export(m, (x,)).module(), quantizer)
        rows = forward_rows(bnswap.plan(prepared, device="cuda"))
        cell = TABLE["export"]["float32"][1 if swapped else 0]
        assert [r.kernel_before for r in rows] == [KERNEL[cell]]
        if TORCH_ANSWERS:
            assert [_plain(r.kernel_before) for r in rows] == torch_answers(prepared, (x,))


# ------------------------------------------------------------------ the rule itself
def _call(**kw) -> kernels.Call:
    base = dict(
        rank=4,
        dtype=torch.float32,
        weight=torch.float32,
        bias=torch.float32,
        running_mean=True,
        running_var=True,
        training=True,
        eps=1e-5,
        batch=8,
        numel=8 * 4 * 9,
    )
    base.update(kw)
    return kernels.Call(**base)


#: each condition of torch's rule at its edge: (the call, the answer on CUDA)
EDGES = [
    (_call(), "Cudnn"),
    (_call(rank=2, numel=32), "Native"),
    (_call(rank=3), "Cudnn"),
    (_call(dtype=torch.bfloat16, weight=torch.float32), "Native"),
    (_call(dtype=torch.float32, weight=torch.bfloat16, bias=torch.bfloat16), "Native"),
    (_call(dtype=torch.float16, weight=torch.float16, bias=torch.float16), "Native"),
    (_call(dtype=torch.float16), "Cudnn"),
    (_call(dtype=torch.float64, weight=torch.float64, bias=torch.float64), "Cudnn"),
    (_call(weight=None), "Native"),
    (_call(bias=None), "Native"),
    (_call(running_mean=False, running_var=False), "Cudnn"),
    (_call(running_mean=False, running_var=False, training=False), "Native"),
    (_call(running_var=False), "Native"),
    (_call(eps=1e-5), "Cudnn"),
    (_call(eps=9.99e-6), "Cudnn"),  # cuDNN 9's CUDNN_BN_MIN_EPSILON: 0.0
    (_call(eps=0.0), "Cudnn"),
    (_call(eps=-1e-3), "Native"),
    (_call(batch=880_801, numel=880_801), "Cudnn"),
    (_call(batch=880_802, numel=880_802), "Native"),
    (_call(batch=65_535, numel=65_535, training=False), "Cudnn"),
    (_call(batch=65_536, numel=65_536, training=False), "Native"),
    (_call(batch=1, numel=2**31 - 2), "Cudnn"),
    (_call(batch=1, numel=2**31 - 1), "Native"),
]


@pytest.mark.parametrize("call, answer", EDGES)
def test_the_rule_at_each_condition(call, answer):
    """Guards each condition of torch's rule (a wrong limit, a dtype pair, the flag);
    where torch is a CUDA build, torch answers on fake CUDA tensors of that shape."""
    assert kernels.rule(call, rocm=False, cudnn_enabled=True) == answer
    assert kernels.rule(call, rocm=False, cudnn_enabled=False) == "Native"
    if TORCH_ANSWERS and call.weight is not None and call.bias is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        per = call.numel // call.batch  # (N, C, *) with that element count
        shape = (call.batch, per) + (1,) * (call.rank - 2)
        with FakeTensorMode():
            x = torch.empty(shape, dtype=call.dtype, device="cuda")
            w = torch.empty(per, dtype=call.weight, device="cuda")
            b = torch.empty(per, dtype=call.bias, device="cuda")
            stats = torch.empty(per, device="cuda")
            m = stats if call.running_mean else None
            v = stats if call.running_var else None
            if m is None or v is None:
                assert answer == "Native" or (m is None and v is None)
                if m is None and v is None and call.training:
                    m = v = stats  # (the binding: both, as neither in training)
                else:
                    return
            with torch.backends.cudnn.flags(enabled=True):
                got = torch._C._select_batch_norm_backend(x, w, b, m, v, call.training, call.eps)
            with torch.backends.cudnn.flags(enabled=False):
                off = torch._C._select_batch_norm_backend(x, w, b, m, v, call.training, call.eps)
        assert (got.name, off.name) == (answer, "Native")


@pytest.mark.skipif(not TORCH_ANSWERS, reason="needs a CUDA build of torch (no GPU needed)")
def test_aten_batch_norm_ignores_cudnn_enabled():
    """torch's code: ``aten.batch_norm(..., cudnn_enabled=False)`` (what torch.export
    records) dispatches cuDNN; the global flag decides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for flag, enabled, want in ((False, True, "Cudnn"), (True, False, "Native")):
        with FakeTensorMode():
            x = torch.empty(4, 3, 5, 5, device="cuda")
            w = torch.ones(3, device="cuda")
            with torch.backends.cudnn.flags(enabled=enabled), _FirstKernelOp() as seen:
                aten.batch_norm.default(x, w, w, w.clone(), w.clone(), True, 0.1, 1e-5, flag)
        assert seen.answers == [want]


def test_native_bound_ops_have_native_cuda_kernels():
    """torch's ``native_functions.yaml`` (shipped with torch, in torchgen): the ops
    bnswap.kernels calls bound to the native kernel have the native CUDA kernels (or a
    composite one that calls such an op); the ones it says select have CUDA kernels of
    their own; ``_batch_norm_no_update`` has none."""
    yaml = pytest.importorskip("yaml")
    path = pathlib.Path(importlib.import_module("torchgen").__file__).parent
    path = path / "packaged" / "ATen" / "native" / "native_functions.yaml"
    if not path.exists():
        pytest.skip("this torch ships no native_functions.yaml")
    entries = {
        e["func"].split("(")[0]: e.get("dispatch", {}) for e in yaml.safe_load(path.read_text())
    }
    cuda = {name: d.get("CUDA") for name, d in entries.items()}
    assert cuda["native_batch_norm"] == "batch_norm_cuda"
    assert cuda["_native_batch_norm_legit"] == "_batch_norm_legit_cuda"
    assert cuda["_native_batch_norm_legit.no_stats"] == "_batch_norm_legit_no_stats_cuda"
    assert cuda["native_batch_norm_backward"] == "batch_norm_backward_cuda"
    assert entries["_native_batch_norm_legit_no_training"] == {
        "CompositeExplicitAutograd": "_batch_norm_legit_no_training"
    }
    assert cuda["_batch_norm_with_update"] == "_batch_norm_with_update_cuda"
    assert cuda["batch_norm_backward"] == "_new_batch_norm_backward_cuda"
    assert entries["_batch_norm_no_update"] == {
        "CompositeExplicitAutograd": "_batch_norm_no_update"
    }
    assert entries["batch_norm"] == {}  # CompositeImplicitAutograd: _batch_norm_impl_index


def test_plan_of_a_program_without_validate(monkeypatch):
    """torch 2.4's ExportedProgram has no public ``validate()``: ``bnswap.plan(ep)`` and
    ``bnswap.convert(ep)`` raised AttributeError there (make compat runs this file on
    2.4.1 for real)."""
    ep = torch.export.export(nn.Sequential(nn.BatchNorm2d(3)), (torch.randn(2, 3, 4, 4),))
    if hasattr(type(ep), "validate"):
        monkeypatch.delattr(type(ep), "validate")
    (row,) = bnswap.plan(ep, device="cuda")
    assert row.kernel_before == KERNEL[TABLE["export"]["float32"][0]]
    # and convert (it validates the program it makes, with 2.4's _validate there)
    new = bnswap.convert(ep)
    ops = [str(n.target) for n in new.graph.nodes if "batch_norm" in str(n.target)]
    # (torch 2.4's export records the functional _native_batch_norm_legit_functional)
    functional = "_functional" if OLD_EXPORT else ""
    assert ops == [f"aten._batch_norm_with_update{functional}.default"]


def test_an_old_bnswap_eval_node_runs_on_the_cpu_only():
    """``_batch_norm_no_update`` (what bnswap recorded in eval before issue 44) has one
    kernel, CompositeExplicitAutograd, which calls ``batch_norm_cpu``: its row says so off
    the CPU (``bnswap.convert`` makes it stock's ``aten.batch_norm(training=False)``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b, mean, var):
        return aten._batch_norm_no_update.default(x, w, b, mean, var, 0.1, 1e-5)[0]

    c = torch.ones(3)
    gm = make_fx(f)(torch.randn(2, 3, 4, 4), c, c, c, c)
    (row,) = bnswap.plan(gm, device="cuda")
    assert row.op == "aten._batch_norm_no_update.default"
    assert row.kernel_before == "CPU only (no CUDA kernel)"
    assert bnswap.plan(gm, device="cpu")[0].kernel_before == "Native"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_batch_norm_no_update", "CUDA")
