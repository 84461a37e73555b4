"""Off the CPU: every swapped layer runs on a device other than the CPU, in every mode, as
stock's layer does there.

This machine has no GPU. torch's **Lazy device** (``torch._lazy``, its TorchScript
backend, in every CPU wheel) is a device other than the CPU whose dispatch of the
batch-norm ops is the one CUDA, MPS and XPU get: a kernel registered for the CPU alone
is not reached, and a shared (``CompositeExplicitAutograd``) kernel that calls CPU code
raises there as on a GPU. That is how ``aten._batch_norm_no_update`` failed every
swapped layer's evaluation off the CPU (its one kernel calls ``batch_norm_cpu``,
``"Expected tensor to have CPU Backend, but got tensor with Lazy Backend"``). The Lazy
device's limit: it runs the ops it cannot lower on the CPU (its eager fallback), so it
catches shared kernels that call CPU code, not a missing CUDA kernel; the dispatch table
of a CUDA build covers that (:func:`test_every_op_a_swapped_layer_runs_has_a_cuda_kernel`,
in the zoo environment's torch 2.14.1+cu130).

Every comparison is against stock ``nn.BatchNorm`` on an identical copy on the same
device; tiny tensors (the Lazy device traces and runs each step)."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bnswap
from tests._helpers import BLOCK_BNSWAP, lazy_device, run_script

lazy = pytest.importorskip("torch._lazy")


@pytest.fixture(scope="module")
def device() -> str:
    return lazy_device()


def _sync(*tensors):
    """Run what the Lazy device traced; the results on the CPU."""
    torch._lazy.mark_step()
    return [None if t is None else t.detach().cpu() for t in tensors]


#: (id, layer factory, input shape, input dtype, channels_last)
LAYERS = [
    ("1d_NC", lambda: nn.BatchNorm1d(3), (5, 3), torch.float32, False),
    ("1d_NCL", lambda: nn.BatchNorm1d(3), (4, 3, 5), torch.float32, False),
    ("2d", lambda: nn.BatchNorm2d(3), (2, 3, 4, 4), torch.float32, False),
    ("2d_channels_last", lambda: nn.BatchNorm2d(3), (2, 3, 4, 4), torch.float32, True),
    ("3d", lambda: nn.BatchNorm3d(3), (2, 3, 2, 3, 3), torch.float32, False),
    ("affine_false", lambda: nn.BatchNorm2d(3, affine=False), (2, 3, 4, 4), torch.float32, False),
    (
        "no_running_stats",
        lambda: nn.BatchNorm2d(3, track_running_stats=False),
        (2, 3, 4, 4),
        torch.float32,
        False,
    ),
    ("momentum_none", lambda: nn.BatchNorm2d(3, momentum=None), (2, 3, 4, 4), torch.float32, False),
    # what autocast hands a batch norm on a GPU: half input (a convolution's output),
    # float32 weight, bias and statistics (torch's mixed-dtype path; the Lazy device
    # takes no autocast of its own)
    ("float16_input", lambda: nn.BatchNorm2d(3), (2, 3, 4, 4), torch.float16, False),
    ("bfloat16_input", lambda: nn.BatchNorm2d(3), (2, 3, 4, 4), torch.bfloat16, False),
]


def _init(layer: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if layer.weight is not None:
            layer.weight.copy_(torch.rand(layer.num_features, generator=g) + 0.5)
            layer.bias.copy_(torch.randn(layer.num_features, generator=g))
        if layer.running_mean is not None:
            layer.running_mean.copy_(torch.randn(layer.num_features, generator=g))
            layer.running_var.copy_(torch.rand(layer.num_features, generator=g) + 0.5)
    return layer


def _steps(layer: nn.Module, shape, dtype, channels_last, device, train: bool):
    """Two forward + backward steps of ``layer`` (on ``device``) in ``train`` mode; the
    outputs, input and parameter gradients and the state after each, on the CPU."""
    layer.train(train)
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        x = torch.randn(shape, generator=g).to(dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x = x.to(device).requires_grad_(True)
        y = layer(x)
        dy = torch.randn(shape, generator=g).to(dtype).to(device)
        y.backward(dy)
        params = [p.grad for p in layer.parameters()]
        state = list(layer.state_dict().values())
        out.append(_sync(y, x.grad, *params, *state))
        for p in layer.parameters():
            p.grad = None
    return out


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    ("kind", "make", "shape", "dtype", "channels_last"), LAYERS, ids=[c[0] for c in LAYERS]
)
def test_swapped_layer_runs_off_the_cpu_as_stock(
    device, kind, make, shape, dtype, channels_last, train
):
    """Forward, backward, running statistics and num_batches_tracked of a swapped layer on
    the Lazy device, two steps, against stock's identical layer there: bitwise (both end
    in the same kernels). (The memory format is checked on the CPU, tests/test_layers.py:
    the Lazy device keeps none.)"""
    stock = _init(make())
    swapped = bnswap.convert(copy.deepcopy(stock))
    got = _steps(swapped.to(device), shape, dtype, channels_last, device, train)
    ref = _steps(stock.to(device), shape, dtype, channels_last, device, train)
    for g_step, r_step in zip(got, ref, strict=True):
        assert len(g_step) == len(r_step)
        for a, b in zip(g_step, r_step, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), kind


def _on(device):
    """An aot_autograd backend that runs the forward and backward graphs it is given on
    ``device`` (inputs moved there, outputs back to the CPU): a compiled model's graphs,
    captured with CPU tensors, run off the CPU op for op."""
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, example_inputs):
        def run(*args):
            moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            outs = gm(*moved)
            torch._lazy.mark_step()
            return type(outs)(o.cpu() if isinstance(o, torch.Tensor) else o for o in outs)

        run._boxed_call = False
        return run

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _net(**bn):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, **bn),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4, affine=False),
    )


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_compiled_graphs_of_a_swapped_model_run_off_the_cpu(device, train):
    """torch.compile (aot_autograd): the forward and backward graphs of a swapped model run
    on the Lazy device, op for op, as stock's do; the same numbers as stock's graphs there."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    results = []
    for model in (_net(), bnswap.convert(_net())):
        model.train(train)
        torch._dynamo.reset()
        fn = torch.compile(model, backend=_on(device), fullgraph=True)
        y = fn(x.clone().requires_grad_(True))
        y.sum().backward()
        results.append(
            [y.detach(), *(p.grad for p in model.parameters()), *model.state_dict().values()]
        )
    torch._dynamo.reset()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


#: The prologue of a fresh interpreter where importing bnswap fails, on the Lazy device.
_NO_BNSWAP = BLOCK_BNSWAP + textwrap.dedent(
    """
    import torch, torch._lazy, torch._lazy.ts_backend
    torch._lazy.ts_backend.init()
    from torch.export.passes import move_to_device_pass
    """
)


def _run_without_bnswap(body: str) -> str:
    code = (
        _NO_BNSWAP
        + textwrap.dedent(body)
        + textwrap.dedent(
            """
            assert not any(k.startswith("bnswap") for k in sys.modules if sys.modules[k])
            print("no bnswap:", sys.modules.get("bnswap") is None)
            """
        )
    )
    rc, out, err = run_script(code, timeout=240)
    assert rc == 0, err[-4000:]
    assert "no bnswap: True" in out, out
    return out


def _bn_ops(ep) -> list[str]:
    return [
        str(n.target)
        for n in ep.graph.nodes
        if n.op == "call_function" and "batch_norm" in str(n.target)
    ]


def test_programs_bnswap_wrote_run_off_the_cpu_where_bnswap_is_not_installed(device, tmp_path):
    """.pt2 files bnswap wrote (torch.export of a converted model in train and eval, and
    ``bnswap convert`` of a stock program) load in a fresh interpreter without bnswap and
    run on the Lazy device after ``.to(device)`` and ``move_to_device_pass``, with the CPU
    program's outputs and buffer updates (torch's own ops only: nothing bnswap registers)."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    files = []
    for train in (True, False):
        for label in ("swapped", "converted"):
            # (momentum=None: a swapped layer exports its cumulative average; torch.export
            # of stock's raises, pytorch issue 194504)
            stock = _net(momentum=None if label == "swapped" else 0.1).train(train)
            ep = (
                torch.export.export(bnswap.convert(copy.deepcopy(stock)), (x,))
                if label == "swapped"
                else bnswap.convert(torch.export.export(copy.deepcopy(stock), (x,)))
            )
            ops = _bn_ops(ep)
            assert "aten._batch_norm_no_update.default" not in ops, ops
            path = tmp_path / f"{label}_{'train' if train else 'eval'}.pt2"
            torch.export.save(ep, path)
            ref = copy.deepcopy(stock)
            y = ref(x)
            torch.save([y, *ref.state_dict().values()], str(path) + ".ref")
            files.append(str(path))
    out = _run_without_bnswap(
        f"""
        x = torch.load({str(tmp_path / "x.pt")!r})
        for path in {files!r}:
            ref = torch.load(path + ".ref")
            for how in ("to", "pass"):
                ep = torch.export.load(path)
                if how == "to":
                    m = ep.module().to("lazy")
                else:
                    m = move_to_device_pass(ep, "lazy").module()
                y = m(x.to("lazy"))
                torch._lazy.mark_step()
                got = [y.cpu(), *(t.cpu() for t in m.state_dict().values())]
                assert len(got) == len(ref), (path, len(got), len(ref))
                for a, b in zip(got, ref):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
                print("ran", how, path.rsplit("/", 1)[1])
        """
    )
    assert out.count("ran ") == 2 * len(files), out


def test_old_no_update_programs_become_runnable_off_the_cpu(device):
    """A program of an earlier bnswap (evaluation on aten._batch_norm_no_update, with
    aten.full_like stand-ins for an affine=False layer, as its layers recorded) fails on the
    Lazy device, as on a GPU; ``bnswap.plan`` says so and ``bnswap.convert`` rewrites it into
    stock's aten.batch_norm (stand-ins gone), which runs there with stock's numbers."""

    class Old(nn.Module):  # what an earlier bnswap layer recorded in evaluation
        def __init__(self, bn: nn.BatchNorm2d):
            super().__init__()
            self.bn = bn

        def forward(self, x):
            bn = self.bn
            w = bn.weight if bn.weight is not None else torch.full_like(bn.running_mean, 1.0)
            b = bn.bias if bn.bias is not None else torch.full_like(bn.running_mean, 0.0)
            return torch.ops.aten._batch_norm_no_update.default(
                x, w, b, bn.running_mean, bn.running_var, 0.1, bn.eps
            )[0]

    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    for affine in (True, False):
        stock = _init(nn.BatchNorm2d(4, affine=affine)).eval()
        ep = torch.export.export(Old(copy.deepcopy(stock)), (x,))
        assert _bn_ops(ep) == ["aten._batch_norm_no_update.default"]
        with pytest.raises(RuntimeError, match="Expected tensor to have CPU Backend"):
            ep.module().to(device)(x.to(device))
            torch._lazy.mark_step()
        row = bnswap.plan(ep)[0]
        assert (row.action, row.becomes) == ("swap", "aten.batch_norm.default")
        new = bnswap.convert(ep)
        assert _bn_ops(new) == ["aten.batch_norm.default"]
        bn_node = next(n for n in new.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
        assert (bn_node.args[1] is None) == (not affine)  # the stand-ins are None again
        assert "full_like" not in new.graph_module.code
        (got,) = _sync(new.module().to(device)(x.to(device)))
        assert torch.equal(got, stock(x))


def test_pt2e_qat_graphs_run_off_the_cpu(device):
    """pt2e QAT: a converted model's prepared graph and the graph
    ``move_exported_model_to_eval`` switches are stock's, node for node (bnswap's torchao
    patch hands torchao stock's ops and puts nothing back), and run on the Lazy device
    with stock's numbers there and the CPU's."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    from tests._pt2e import graph_of, xnnpack

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    graphs = []
    for m in (stock, bnswap.convert(copy.deepcopy(stock))):
        graphs.append(prepare_qat_pt2e(torch.export.export(m, (x,)).module(), xnnpack()))
    ps, pb = graphs
    for stage in ("train", "eval"):
        if stage == "eval":
            ps, pb = move_exported_model_to_eval(ps), move_exported_model_to_eval(pb)
        assert _bn_ops(pb) == ["aten.batch_norm.default"] and graph_of(pb) == graph_of(ps)
        ref = copy.deepcopy(pb)(x)
        (got, got_stock) = _sync(
            copy.deepcopy(pb).to(device)(x.to(device)), copy.deepcopy(ps).to(device)(x.to(device))
        )
        assert torch.equal(got, got_stock), stage
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- synchronized layers
def test_synchronized_layer_per_rank_steps_run_off_the_cpu(device):
    """A synchronized layer's work on each rank (everything but the two collectives:
    statistics, their combination, the normalization, the backward's sums and input
    gradient, ``bnswap.sync``'s steps) on the Lazy device for 3 ranks of uneven batches,
    one empty, in one process, the collectives' results made as they make them (every
    rank's rows in rank order; their sum). Against stock ``nn.BatchNorm2d`` on the CPU
    over the global batch in float64. Unshown until a GPU: the collectives themselves on
    a GPU backend (NCCL) and the CUDA kernels of the per-device slots."""
    from bnswap import sync

    g = torch.Generator().manual_seed(4)
    sizes = [3, 0, 2]
    xs = [torch.randn(n, 3, 4, 4, generator=g) for n in sizes]
    dys = [torch.randn(n, 3, 4, 4, generator=g) for n in sizes]
    weight, bias, eps = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g), 1e-5
    # stock on the global batch, float64
    ref = nn.BatchNorm2d(3, eps=eps).double()
    with torch.no_grad():
        ref.weight.copy_(weight.double())
        ref.bias.copy_(bias.double())
    xg = torch.cat(xs).double().requires_grad_(True)
    yg = ref(xg)
    yg.backward(torch.cat(dys).double())

    w, b = weight.to(device), bias.to(device)
    locals_ = [sync.rank_stats(x.to(device), w, b, compiling=False) for x in xs]
    gathered = torch.stack([loc.packed for loc in locals_])  # what the all_gather returns
    outs, grads = [], []
    per_rank_sums = []
    for x, dy, loc in zip(xs, dys, locals_, strict=True):
        stats = sync.global_stats(gathered, eps, False, x.size(), None)
        outs.append(sync.rank_output(x.to(device), loc, w, b, stats, eps))
        per_rank_sums.append(
            (
                stats,
                sync.rank_sums(dy.to(device), x.to(device), stats.mean, stats.invstd, w, loc.slots),
            )
        )
    sums = torch.stack([torch.cat([s[2], s[3]]) for _, s in per_rank_sums]).sum(
        0
    )  # the sum over ranks
    for stats, (dy, x, _sd, _sdx, xmu, _kernels) in per_rank_sums:
        grads.append(
            sync.rank_input_grad(
                dy, x, xmu, stats.mean, stats.invstd, w, sums, stats.counts, stats.n, None
            )
        )
    stats = per_rank_sums[0][0]
    assert stats.total == sum(sizes) * 4 * 4  # values per channel
    got_out = torch.cat(_sync(*outs))
    got_grad = torch.cat(_sync(*grads))
    torch.testing.assert_close(got_out.double(), yg.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.double(), xg.grad, rtol=1e-5, atol=1e-5)
    grad_weight = sum(s[3] for _, s in per_rank_sums) * stats.invstd
    grad_bias = sum(s[2] for _, s in per_rank_sums)
    gw, gb, mean, unbiased = _sync(grad_weight, grad_bias, stats.mean, stats.unbiased)
    torch.testing.assert_close(gw.double(), ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb.double(), ref.bias.grad, rtol=1e-5, atol=1e-5)
    # what running_mean / running_var take: the global batch's mean and unbiased variance
    flat = torch.cat(xs).double().transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean.double(), flat.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unbiased.double(), flat.var(1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------- CUDA's dispatch table
class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _ops_a_swapped_layer_runs() -> set:
    """Every op a swapped layer (each kind of :data:`LAYERS`) dispatches below autograd in
    training and evaluation, forward and backward, eager and in an AOT graph (recorded on
    the CPU: the ops are the same on every device, their kernels are not)."""
    from torch._functorch.aot_autograd import aot_function

    rec = _Ops()
    for _kind, make, shape, dtype, channels_last in LAYERS:
        layer = bnswap.convert(_init(make()))
        for train in (True, False):
            layer.train(train)
            x = torch.randn(shape).to(dtype)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_(True)
            with rec:
                layer(x).sum().backward()
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    for train in (True, False):
        model = bnswap.convert(_net()).train(train)
        params = dict(model.named_parameters()) | dict(model.named_buffers())

        def f(p, x, model=model):
            return torch.func.functional_call(model, p, (x,))

        fn = aot_function(f, fw_compiler=keep, bw_compiler=keep)
        fn(params, torch.randn(2, 3, 6, 6, requires_grad=True)).sum().backward()
    for gm in graphs:
        rec.ops.update(
            n.target for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
        )
    return rec.ops


#: Shared kernels (registered once for every backend): an op with one runs wherever the
#: ops it calls run, unless the kernel calls CPU code itself, which the Lazy device tests
#: above catch (every op recorded here ran there: the same layers, modes and graphs).
_SHARED = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def test_every_op_a_swapped_layer_runs_has_a_cuda_kernel():
    """In a CUDA build of torch (the zoo environment's torch 2.14.1+cu130): every op a
    swapped layer runs (each kind, training and evaluation, forward and backward, eager
    and AOT graphs) has a CUDA kernel in torch's dispatch table, or a shared kernel, which
    the Lazy device tests show reaches no CPU-only code. ``aten._batch_norm_no_update``
    has only a shared kernel, and that one calls ``batch_norm_cpu``: a swapped layer
    never runs it."""
    if not torch.version.cuda:
        pytest.skip("needs a CUDA build of torch (its dispatch table); this one is CPU-only")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has("aten::_batch_norm_no_update", "CUDA")
    assert has("aten::_batch_norm_with_update", "CUDA") and has("aten::batch_norm_backward", "CUDA")
    ops = _ops_a_swapped_layer_runs()
    assert torch.ops.aten._batch_norm_no_update.default not in ops
    missing = sorted(
        name
        for op in ops
        if not has(name := op.name(), "CUDA") and not any(has(name, key) for key in _SHARED)
    )
    assert not missing, missing
