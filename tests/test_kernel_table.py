"""README's "Where the kernel differs" table against the code (issue 31, item 4).

Each row names a flow, the batch-norm ops stock's and bnswap's graphs hold in it, and
the test id here that captures the flow on the CPU and reads them: the ops a row lists
are its cell's backticked names outside parentheses ("none": no batch-norm op at all).
The net: ``Conv2d -> BatchNorm2d -> ReLU -> BatchNorm2d`` (the second layer follows no
convolution, so ONNX's optimizer and torchao's fold keep a batch norm), in training
where the flow trains (forward and backward), in eval where it is inference only
(AOTInductor, ONNX). The kernel column follows from the ops by torch's rule
(:mod:`bnswap.kernels`: ``aten.batch_norm``, whatever its ``cudnn_enabled``, and the
consolidated ops select cuDNN on CUDA for such a layer; the ``_native_batch_norm_legit*``
family binds the native kernel), checked for the rows of captured graphs;
``benchmarks/gpu_check.py`` reads kernel names on a GPU.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bnswap
from bnswap import kernels

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Where the kernel differs"
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))


def table() -> dict[str, tuple[list[str], list[str], list[str]]]:
    """test id -> (flow cells, stock's ops, bnswap's ops), from README.md's section."""
    text = README.read_text()
    assert HEADING in text, "README.md lost its kernel table"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| flow")]
    out = {}
    for r in rows:
        cells = [c.strip() for c in r.strip().strip("|").split("|")]
        assert len(cells) == 5, r
        test_id = cells[4].strip("`")
        out[test_id] = (cells, _ops(cells[1]), _ops(cells[2]))
    return out


def _ops(cell: str) -> list[str]:
    """The backticked names of a cell outside parentheses, sorted."""
    outside = re.sub(r"\([^)]*\)", "", cell)
    return sorted(set(re.findall(r"`([^`]+)`", outside)))


def _bn(names) -> list[str]:
    return sorted({n for n in names if "batch_norm" in n.lower() or "batchnorm" in n.lower()})


def _graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target).split(".")[1] if str(n.target).startswith("aten.") else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]


class _Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def eager(m: nn.Module) -> list[str]:
    with _Dispatched() as d:
        m(X).sum().backward()
    return _bn(d.ops)


def _aot(m: nn.Module, decompositions=None) -> list[str]:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ops: list[str] = []

    def record(gm, _inputs):  # the forward / backward graph, run as is
        ops.extend(_graph_ops(gm))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=decompositions)
    torch.compile(m, backend=backend)(X).sum().backward()
    torch._dynamo.reset()
    return _bn(ops)


def inductor(m: nn.Module) -> list[str]:
    """The graphs inductor lowers: AOTAutograd with inductor's decomposition table (what
    torch.compile's default backend runs before generating code; no code generated)."""
    from torch._inductor.decomposition import select_decomp_table

    return _aot(m, select_decomp_table())


def aot_eager(m: nn.Module) -> list[str]:
    return _aot(m)


def export(m: nn.Module) -> list[str]:
    return _bn(_graph_ops(torch.export.export(m, (X,)).module()))


def core_aten(m: nn.Module) -> list[str]:
    return _bn(_graph_ops(torch.export.export(m, (X,)).run_decompositions().graph_module))


def training_ir(m: nn.Module) -> list[str]:
    return _bn(_graph_ops(torch.export.export(m, (X,)).run_decompositions({}).graph_module))


def pt2e_qat(m: nn.Module) -> list[str]:
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!"
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
    gm = torch.export.export(m, (X,)).module()
    return _bn(_graph_ops(prepare_qat_pt2e(gm, quantizer)))


def ao_eager_qat(m: nn.Module) -> list[str]:
    import torch.ao.quantization as tq

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's migration notice
        m = tq.fuse_modules_qat(m, [["0", "1", "2"]])
        m.qconfig = tq.get_default_qat_qconfig("fbgemm")
        prepared = tq.prepare_qat(m)
    return eager(prepared)


def aoti(m: nn.Module) -> list[str]:
    """What AOTInductor lowers: the exported program under inductor's decomposition table
    (no C++ compiled here)."""
    from torch._inductor.decomposition import select_decomp_table

    ep = torch.export.export(m.eval(), (X,))
    return _bn(_graph_ops(ep.run_decompositions(select_decomp_table()).graph_module))


def onnx(m: nn.Module) -> list[str]:
    pytest.importorskip("onnxscript")
    ep = torch.export.export(m.eval(), (X,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(ep, (X,), dynamo=True, verbose=False).model_proto
    return _bn(n.op_type for n in proto.graph.node)


def torchscript(m: nn.Module) -> list[str]:
    return _bn(n.kind() for n in torch.jit.script(m).inlined_graph.nodes())


FLOWS = {
    f.__name__: f
    for f in (
        eager,
        inductor,
        aot_eager,
        export,
        core_aten,
        training_ir,
        pt2e_qat,
        ao_eager_qat,
        aoti,
        onnx,
        torchscript,
    )
}


def test_the_table_has_one_row_per_flow():
    assert list(table()) == list(FLOWS)


@pytest.mark.parametrize("flow", list(FLOWS))
def test_flow_reads_as_the_table_says(flow):
    """Guards: the README promised more than torch gives (a captured graph under the
    default torch.compile backend runs bnswap's ops as stock's). Each row's ops are
    read from the flow's graph, for stock and for an identical converted copy."""
    _, stock_ops, bnswap_ops = table()[flow]
    read = FLOWS[flow](net().train()), FLOWS[flow](bnswap.convert(net().train()))
    assert read == (stock_ops, bnswap_ops)


#: the rows whose graph holds the ops a CUDA run executes as they are (eager's ops are
#: the CPU's; inductor, AOTInductor, ONNX and TorchScript run kernels of their own)
CAPTURED = ("aot_eager", "export", "core_aten", "training_ir", "pt2e_qat")


def _kernel_word(ops: list[str]) -> str:
    """What ``ops`` (one cell's, forward and backward) run on CUDA for the table's
    float32 (N, C, H, W) layer with affine parameters, by bnswap.kernels: "cuDNN" for
    ops that select at run time (the rule holds), "native" for ops bound to it."""
    words = set()
    for name in ops:
        packet = getattr(torch.ops.aten, name)
        if packet in kernels.NATIVE_OPS:
            words.add("native")
        else:
            assert packet in kernels.RUN_TIME_OPS, name
            words.add("cuDNN")
    (word,) = words
    return word


@pytest.mark.parametrize("flow", CAPTURED)
def test_the_kernel_column_follows_from_the_ops(flow):
    """Guards the README's kernel column against torch's rule: it said "native" for
    stock's exported ``aten.batch_norm(cudnn_enabled=False)``, which torch selects at run
    time (cuDNN). The column's first claim is this torch's (a torch 2.4.1 note follows in
    parentheses)."""
    cells, stock_ops, bnswap_ops = table()[flow]
    claim = cells[3].split(" (")[0]
    assert claim == f"{_kernel_word(stock_ops)} / {_kernel_word(bnswap_ops)}"
