"""The guarantee: exported / compiled graphs of converted models use the consolidated ops."""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import bnswap


def model(momentum=0.1):
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.BatchNorm2d(4, affine=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 6),
        nn.BatchNorm1d(6, momentum=momentum),
    )


def ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


LEGACY = (
    "aten.batch_norm.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten._native_batch_norm_legit.default",
    "aten.native_batch_norm.default",
    "aten.native_batch_norm_backward.default",
    "aten.cudnn_batch_norm.default",
)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_export_training_graph(momentum):
    m = bnswap.convert(model(momentum))
    x = torch.randn(2, 3, 8, 8)
    ep = torch.export.export(m, (x,))
    names = ops(ep.graph_module)
    # torch.export.export gives the training IR (mutating ops) on newer releases and an
    # already functional graph on older ones (2.4): the same form as stock's export.
    functional = "aten._native_batch_norm_legit_functional.default" in ops(
        torch.export.export(model(), (x,)).graph_module
    )  # stock refuses momentum=None
    first = "aten._batch_norm_with_update" + ("_functional" if functional else "")
    assert names.count(f"{first}.default") == 3
    assert not set(names) & set(LEGACY)
    dec = ep.run_decompositions({})  # (the default table reaches core ATen: test_programs)
    names = ops(dec.graph_module)
    assert names.count("aten._batch_norm_with_update_functional.default") == 3
    assert not set(names) & set(LEGACY)
    mutated = sorted(dec.graph_signature.buffers_to_mutate.values())
    expect = sorted(
        f"{i}.{b}"
        for i in ("1", "4", "8")
        for b in ("running_mean", "running_var", "num_batches_tracked")
    )
    assert mutated == expect


def test_export_stock_uses_legacy_ops_for_contrast():
    ep = torch.export.export(model(), (torch.randn(2, 3, 8, 8),)).run_decompositions()
    names = ops(ep.graph_module)
    assert "aten._native_batch_norm_legit_functional.default" in names
    assert "aten._batch_norm_with_update_functional.default" not in names


def test_export_eval_graph():
    m = bnswap.convert(model()).eval()
    ep = torch.export.export(m, (torch.randn(2, 3, 8, 8),))
    names = ops(ep.graph_module)
    # evaluation: stock's own op (it runs on every device; _batch_norm_no_update has no
    # kernel off the CPU), so the program is the stock model's: aten.batch_norm, or what
    # torch 2.4's export records of it (_native_batch_norm_legit_no_training)
    stock = torch.export.export(model().eval(), (torch.randn(2, 3, 8, 8),))
    eval_op = next(
        op
        for op in ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default")
        if op in ops(stock.graph_module)
    )
    assert names.count(eval_op) == 3
    assert "aten._batch_norm_no_update.default" not in names
    assert "aten._batch_norm_with_update.default" not in names
    assert names == ops(stock.graph_module)
    assert not ep.run_decompositions().graph_signature.buffers_to_mutate


def test_exported_program_runs_like_eager_stock():
    """The exported program's outputs and its statistics after each call, against eager
    stock BatchNorm on an identical copy (bitwise: the same CPU kernels)."""
    torch.manual_seed(1)
    ref = model()
    m = bnswap.convert(copy.deepcopy(ref))
    x = torch.randn(4, 3, 8, 8)
    run = torch.export.export(m, (x,)).module()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g)
        assert torch.equal(run(x), ref(x))
        buffers = dict(run.named_buffers())
        for k, v in ref.named_buffers():
            assert torch.equal(buffers[k], v), k


def _capture():
    graphs = {"fw": [], "bw": []}

    def fw(gm, example_inputs):
        graphs["fw"].append(gm)
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        graphs["bw"].append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=fw, bw_compiler=bw)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_compile_fullgraph_aot_graphs(momentum):
    torch._dynamo.reset()
    ref = model(momentum)  # eager stock on an identical copy
    m = bnswap.convert(copy.deepcopy(ref))
    graphs, backend = _capture()
    cm = torch.compile(m, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(4, 3, 8, 8, generator=g)
        y, yr = cm(x), ref(x)
        y.square().sum().backward()
        yr.square().sum().backward()
        torch.testing.assert_close(y, yr)
    fw, bw = ops(graphs["fw"][0]), ops(graphs["bw"][0])
    assert fw.count("aten._batch_norm_with_update_functional.default") == 3
    assert bw.count("aten.batch_norm_backward.default") == 3
    assert not (set(fw) | set(bw)) & set(LEGACY)
    assert "aten._assert_scalar.default" not in fw  # the empty-batch check is export's only
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_compile_momentum_none_in_float64_follows_stock():
    """Guards the cumulative factor's cast to the statistics' dtype in the compiled
    momentum=None update (1 / num_batches_tracked is float32; lerp_ refuses a float32
    weight for float64 statistics). Float64 maths: stock and bnswap agree to 1e-12."""
    torch._dynamo.reset()
    ref = model(None).double()
    m = bnswap.convert(copy.deepcopy(ref))
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
        torch.testing.assert_close(cm(x), ref(x), rtol=1e-12, atol=1e-12)
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        assert a.dtype == b.dtype, k
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=k)
    assert int(m[1].num_batches_tracked) == 3


def test_compile_with_dynamic_shapes_carries_no_empty_batch_assertion():
    """The runtime assertion for empty batches belongs to exported programs only (an
    exported graph has no eager early return); torch.compile re-specializes on a batch
    of 0 instead. Guards: the assertion's condition leaking into compiled graphs."""
    torch._dynamo.reset()
    ref = model(0.1)
    m = bnswap.convert(copy.deepcopy(ref))
    graphs, backend = _capture()
    cm = torch.compile(m, backend=backend, fullgraph=True, dynamic=True)
    for n in (4, 5):
        x = torch.randn(n, 3, 8, 8)
        torch.testing.assert_close(cm(x), ref(x))
    fw = [op for g in graphs["fw"] for op in ops(g)]
    assert fw.count("aten._batch_norm_with_update_functional.default") >= 3
    assert "aten._assert_scalar.default" not in fw


@pytest.mark.slow
def test_inductor_matches_eager_with_train_eval_switches():
    torch._dynamo.reset()
    torch.manual_seed(3)
    ref = model(None)  # eager stock on an identical copy
    m = bnswap.convert(copy.deepcopy(ref))
    cm = torch.compile(m)  # inductor
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(8)
    for training in (True, False, True, False, True):
        m.train(training), ref.train(training)
        x = torch.randn(4, 3, 8, 8, generator=g)
        y, yr = cm(x), ref(x)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-5)
        if training:
            for _mod, o, out in ((m, opt, y), (ref, opt_ref, yr)):
                o.zero_grad()
                out.square().mean().backward()
            for a, b in zip(m.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
            opt.step(), opt_ref.step()
    assert m[1].num_batches_tracked.item() == 3
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


def test_momentum_none_traced_with_fake_tensors_outside_dynamo():
    """Guards the path torch 2.4's export and AOT take (they trace torch.nn's modules with
    fake tensors outside dynamo, where ``torch.compiler.is_compiling()`` is False): a
    momentum=None layer read its counter as a float there ("data-dependent expression").
    ``make_fx(tracing_mode="fake")`` takes that path on every release: the graph keeps
    1 / num_batches_tracked and runs like stock eager (outputs bitwise, statistics within
    float32's tolerance: the ulp of momentum=None in graphs, docs/reliability.md)."""
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))
    m = bnswap.convert(copy.deepcopy(ref))
    state = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    gm = make_fx(lambda s, x: functional_call(m, s, (x,)), tracing_mode="fake")(
        state, torch.randn(2, 3, 8, 8)
    )
    assert "aten.div_.Tensor" in {str(n.target) for n in gm.graph.nodes}  # 1 / n, traced
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8)
        assert torch.equal(gm(state, x), ref(x))
        assert torch.equal(m[1].num_batches_tracked, ref[1].num_batches_tracked)
        torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)
        torch.testing.assert_close(m[1].running_var, ref[1].running_var)
