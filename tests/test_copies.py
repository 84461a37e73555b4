"""Copies made by copying a module's ``__dict__`` (issue 32): each runs its own state.

A MAML inner step through learn2learn's ``clone_module`` pattern (written here: the
clone's ``__dict__`` is the original's, copied, with new parameter containers), through
higher's ``innerloop_ctx`` (the real library), and a forward / backward through
``nn.DataParallel``'s replicas (``_replicate_for_data_parallel``, with replicate's
parameter and buffer copies, emulated on the CPU: ``replicate`` itself broadcasts on
CUDA only): query loss, meta-gradients and running statistics equal stock's on an
identical copy, bitwise. Every copy pattern ran the original layer before.
"""

from __future__ import annotations

import copy
import threading

import higher
import pytest
import torch
from torch import nn

import bnswap


def build() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(5, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),
        nn.Linear(6, 1),
    )
    m(torch.randn(8, 5))  # statistics of its own, not the initial ones
    return m


def pair() -> tuple[nn.Module, nn.Module]:
    stock = build()
    return stock, bnswap.convert(copy.deepcopy(stock))


def data(seed: int) -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(seed))


def clone_module(module: nn.Module) -> nn.Module:
    """learn2learn's ``clone_module`` (learn2learn/utils/__init__.py), reduced to what it
    does for these modules: the clone's ``__dict__`` is a copy of the original's, with
    copied parameter / buffer / module dicts, cloned (differentiable) parameters, and the
    original's buffer tensors."""
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = clone._parameters.copy()
    clone._buffers = clone._buffers.copy()
    clone._modules = clone._modules.copy()
    for key, param in module._parameters.items():
        if param is not None:
            clone._parameters[key] = param.clone()
    for key, child in module._modules.items():
        clone._modules[key] = clone_module(child)
    return clone


def update_module(module: nn.Module, lr: float, grads: dict[int, torch.Tensor]) -> None:
    """learn2learn's ``update_module``: each parameter replaced by ``p - lr * g``."""
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None and id(p) in grads:
                m._parameters[key] = p - lr * grads[id(p)]


def maml_step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One MAML step (second order), learn2learn style: adapt a clone on the support set,
    then the query loss and its meta-gradients for the original's parameters."""
    learner = clone_module(model)
    params = list(learner.parameters())
    support = learner(data(1)).square().mean()
    grads = torch.autograd.grad(support, params, create_graph=True)
    update_module(learner, 0.1, {id(p): g for p, g in zip(params, grads, strict=True)})
    query = learner(data(2)).square().mean()
    return query.detach(), list(torch.autograd.grad(query, list(model.parameters())))


def assert_same_state(a: nn.Module, b: nn.Module, graph: bool = False) -> None:
    """Bitwise; ``graph``: after steps in a captured graph, where the ``momentum=None``
    layer's (``4.``) running statistics may be 1-2 ulp off stock's (README: its factor
    ``1 / num_batches_tracked`` is computed in the graph; docs/reliability.md)."""
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        if graph and k.startswith("4.running_"):
            torch.testing.assert_close(x, y, rtol=2.4e-7, atol=0, msg=k)
        else:
            assert torch.equal(x, y), k


def test_maml_step_through_learn2learn_clone_module_equals_stock():
    stock, swapped = pair()
    loss_a, grads_a = maml_step(stock)
    loss_b, grads_b = maml_step(swapped)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    # the clones share the original's buffer tensors: statistics moved alike
    assert_same_state(stock, swapped)
    assert all(bnswap.is_swapped(swapped[i]) for i in (1, 4))


def test_clone_of_a_swapped_layer_runs_bnswaps_kernel_on_its_own_state(monkeypatch):
    """The clone runs the adapter (bnswap's kernel) on its own parameters, not stock's
    forward and not the original's parameters."""
    _, swapped = pair()
    learner = clone_module(swapped)
    seen = []
    mark = vars(swapped[1])[bnswap._swap.SWAP]  # shared with the clone: it names no layer
    adapter = mark.adapter
    monkeypatch.setattr(mark, "adapter", lambda m, *a, **k: seen.append(m) or adapter(m, *a, **k))
    learner(data(1))
    assert seen == [learner[1]]


def higher_step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.zero_grad()
    with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
        diffopt.step(fmodel(data(1)).square().mean())
        query = fmodel(data(2)).square().mean()
        query.backward()
        rows = bnswap.plan(fmodel).rows
    return query.detach(), [p.grad for p in model.parameters()], rows


def assert_higher_step_equal(stock: nn.Module, swapped: nn.Module) -> list:
    """:func:`higher_step` on both: query loss, meta-gradients, statistics bitwise; the
    plan rows of the swapped one's patched copy."""
    loss_a, grads_a, _ = higher_step(stock)
    loss_b, grads_b, rows = higher_step(swapped)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert_same_state(stock, swapped)
    return rows


def test_maml_step_through_higher_equals_stock():
    rows = assert_higher_step_equal(*pair())
    # higher's class (its forward sets the fast weights, then calls the class's: bnswap's
    # dispatcher) carries the swap's mark: swapped
    assert [(r.action, r.reason) for r in rows] == [("keep", "already swapped")] * 2


def test_maml_step_through_higher_on_a_synchronized_model_equals_stock():
    """``convert(..., sync_batchnorm=True)`` keeps each original layer on its stand-in;
    higher copies every attribute with ``setattr``, which made a kept Module a child of
    the patched copy (``AttributeError: ... no attribute '_param_names'``). One process,
    no process group: the stand-ins normalize the local batch, as stock's layers do."""
    stock = build()
    swapped = bnswap.convert(copy.deepcopy(stock), sync_batchnorm=True)
    assert type(swapped[1]) is nn.SyncBatchNorm and bnswap.is_swapped(swapped[1])
    assert_higher_step_equal(stock, swapped)
    assert list(swapped.state_dict()) == list(stock.state_dict())


def replica(model: nn.Module) -> nn.Module:
    """One ``nn.DataParallel`` replica as ``torch.nn.parallel.replicate`` builds it for
    another device: ``_replicate_for_data_parallel`` of every module, the parameters set
    as non-leaf copies (attributes, not Parameters), the buffers copied."""
    copies = {}
    for m in model.modules():
        copies[m] = m._replicate_for_data_parallel()
    for m, r in copies.items():
        for key, child in m._modules.items():
            r._modules[key] = copies[child]
        for key, p in m._parameters.items():
            setattr(r, key, p * 1)  # non-leaf, differentiable to the original
        for key, b in m._buffers.items():
            if b is not None:
                setattr(r, key, b.clone())
    return copies[model]


def test_dataparallel_replica_equals_stock():
    stock, swapped = pair()
    ra, rb = replica(stock), replica(swapped)
    for r in (ra, rb):
        r(data(3)).square().mean().backward()
    assert_same_state(ra, rb)  # the replicas' own statistics moved
    assert_same_state(stock, swapped)  # the originals' did not (alike)
    for a, b in zip(stock.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    ra.eval(), rb.eval()
    assert torch.equal(ra(data(4)), rb(data(4)))


def test_a_reference_held_elsewhere_changes_nothing():
    """Holding ``layer.forward`` elsewhere (a second holder of the entry) leaves the
    layer's own calls as they were: with and without hooks, and called directly."""
    stock, swapped = pair()
    held = [m.forward for m in swapped.modules() if bnswap.is_swapped(m)]
    handle = swapped[4].register_forward_pre_hook(lambda m, a: None)
    ya, yb = stock(data(5)), swapped(data(5))
    assert torch.equal(ya, yb)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(6))
    assert torch.equal(stock[1].forward(x), held[0](x))
    handle.remove()
    assert_same_state(stock, swapped)


def diverge(module: nn.Module, own_buffers: bool = False) -> nn.Module:
    """Give a copy's BatchNorm layers state of their own, so that running the original's
    would show: weight * 3, bias + 1 (in ``_parameters``, as learn2learn's update does),
    and with ``own_buffers`` cloned running statistics (learn2learn shares the
    original's buffer tensors, DataParallel's replicas do not)."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m._parameters = dict(m._parameters, weight=m.weight * 3, bias=m.bias + 1)
            if own_buffers:
                m._buffers = {k: b.clone() for k, b in m._buffers.items()}
    return module


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("own_buffers", [False, True])
def test_clone_forward_called_directly_equals_stock(own_buffers):
    """``clone[1].forward(x)`` by hand: no ``nn.Module.__call__`` frame says which module
    holds the entry, and the entry is bound to the original; the clone's weights and
    statistics must run, not the original's."""
    stock, swapped = pair()
    ca, cb = (diverge(clone_module(m), own_buffers) for m in (stock, swapped))
    for i in (1, 4):
        assert torch.equal(ca[i].forward(hidden(i)), cb[i].forward(hidden(i)))
    assert_same_state(ca, cb)
    assert_same_state(stock, swapped)
    ca.eval(), cb.eval()
    assert torch.equal(ca[1].forward(hidden(7)), cb[1].forward(hidden(7)))


def test_compiled_clone_equals_compiled_stock_clone():
    """``torch.compile`` of a learn2learn clone: dynamo traces the entry, bound to the
    original (``torch.compiler.is_compiling`` skips the caller check); the graph must read
    the clone's weights. Bitwise: both sides compiled with the same backend."""
    torch._dynamo.reset()
    stock, swapped = pair()
    ca, cb = (diverge(clone_module(m)) for m in (stock, swapped))
    ya = torch.compile(ca, backend="aot_eager")(data(1))
    yb = torch.compile(cb, backend="aot_eager")(data(1))
    assert torch.equal(ya, yb)
    assert_same_state(stock, swapped)  # shared buffers: the clones' statistics


def test_compiled_clone_after_compiled_original_equals_stock():
    """The original compiled and run first, then its clone: dynamo may reuse the
    original's cached graph (same code, guards that pass for the clone), which reads the
    original's weights."""
    torch._dynamo.reset()
    stock, swapped = pair()
    for m in (stock, swapped):
        torch.compile(m, backend="aot_eager")(data(0))
    assert_same_state(stock, swapped)
    ca, cb = (diverge(clone_module(m)) for m in (stock, swapped))
    ya = torch.compile(ca, backend="aot_eager")(data(1))
    yb = torch.compile(cb, backend="aot_eager")(data(1))
    assert torch.equal(ya, yb)
    assert_same_state(stock, swapped, graph=True)
    ca.eval(), cb.eval()
    # eval normalizes with those statistics: as close as they are, not bitwise
    torch.testing.assert_close(
        torch.compile(ca, backend="aot_eager")(data(2)),
        torch.compile(cb, backend="aot_eager")(data(2)),
        rtol=1e-6,
        atol=1e-6,
    )


def first_order_maml_step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`maml_step`, first order: aot_autograd refuses double backward ("does not
    currently support double backward"), for stock too, so a second-order step cannot
    run inside ``torch.compile``."""
    learner = clone_module(model)
    params = list(learner.parameters())
    grads = torch.autograd.grad(learner(data(1)).square().mean(), params)
    update_module(learner, 0.1, {id(p): g for p, g in zip(params, grads, strict=True)})
    query = learner(data(2)).square().mean()
    return query.detach(), list(torch.autograd.grad(query, list(model.parameters())))


def test_maml_step_inside_torch_compile_equals_stock():
    """A whole (first-order) MAML step in ``torch.compile``: the clone is made, adapted
    and run inside the compiled function."""
    torch._dynamo.reset()
    stock, swapped = pair()
    step = torch.compile(first_order_maml_step, backend="aot_eager")
    loss_a, grads_a = step(stock)
    loss_b, grads_b = step(swapped)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert_same_state(stock, swapped, graph=True)


@pytest.mark.parametrize("way", ["call", "forward"])
def test_original_and_copy_in_two_threads_equal_stock(way):
    """The original layer and a ``__dict__`` copy (weights and statistics of its own)
    called at once from two threads, training: each gets stock's outputs and statistics,
    which per-call global state (a "current caller" set for the call) would mix up."""
    stock, swapped = pair()
    layers = {}
    for name, m in (("stock", stock), ("swapped", swapped)):
        layers[name] = (m[1], diverge(clone_module(m[1]), own_buffers=True))
    n = 200
    inputs = [[hidden(100 + 2 * i + k) for i in range(n)] for k in (0, 1)]

    def run(layer: nn.Module, xs: list[torch.Tensor], out: list, barrier=None) -> None:
        if barrier is not None:
            barrier.wait()
        f = layer if way == "call" else layer.forward
        out.extend(f(x).detach() for x in xs)

    expected: list[list[torch.Tensor]] = [[], []]
    for k in (0, 1):
        run(layers["stock"][k], inputs[k], expected[k])
    got: list[list[torch.Tensor]] = [[], []]
    barrier = threading.Barrier(2)
    threads = [
        threading.Thread(target=run, args=(layers["swapped"][k], inputs[k], got[k], barrier))
        for k in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):  # k = 0: the original's outputs, 1: the copy's
        assert len(got[k]) == n
        for i, (a, b) in enumerate(zip(expected[k], got[k], strict=True)):
            assert torch.equal(a, b), ("output", k, i)
    for k in (0, 1):
        assert_same_state(layers["stock"][k], layers["swapped"][k])


def test_copy_copy_forward_called_directly_equals_stock():
    """``copy.copy`` of a swapped layer (parameters and statistics of its own) and then
    ``copy.forward(x)`` by hand: the copy's state runs, never the original's."""
    stock, swapped = pair()
    ca, cb = (diverge(copy.copy(m[1]), own_buffers=True) for m in (stock, swapped))
    assert torch.equal(ca.forward(hidden(8)), cb.forward(hidden(8)))
    assert torch.equal(ca(hidden(9)), cb(hidden(9)))
    assert_same_state(ca, cb)
    assert_same_state(stock, swapped)
    ca.eval(), cb.eval()
    assert torch.equal(ca.forward(hidden(10)), cb.forward(hidden(10)))


def test_torchscript_of_a_clone_records_stocks_op():
    """``torch.jit.trace`` / ``torch.jit.script`` of a learn2learn clone in eval record
    stock's ``aten::batch_norm`` on the clone's own state (tracing the clone raised while
    the swap was an instance forward bound to the original)."""
    stock, swapped = pair()
    ca, cb = (diverge(clone_module(m)).eval() for m in (stock, swapped))
    traced = torch.jit.trace(cb, data(1))
    assert "aten::batch_norm" in str(traced.inlined_graph)
    assert "_batch_norm" not in str(traced.inlined_graph).replace("aten::batch_norm", "")
    scripted = torch.jit.script(cb)
    with torch.no_grad():
        for m in (traced, scripted):
            assert torch.equal(m(data(2)), ca(data(2)))


def test_revert_of_a_clone_of_a_synchronized_model_keeps_the_clones_state():
    """``convert(..., sync_batchnorm=True)`` keeps each original layer in its stand-in's
    ``__dict__`` for ``revert``; a clone of the stand-in carries that reference, and
    ``revert(clone)`` put the original model's layer (its parameters, its statistics)
    into the clone. The clone gets a layer of the original's class on its own state."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model = bnswap.convert(copy.deepcopy(stock), sync_batchnorm=True)  # one process: local
    cs, cb = (diverge(clone_module(m)) for m in (stock, model))
    x = torch.randn(4, 3, 6, 6)
    assert torch.equal(cs(x), cb(x))
    assert bnswap.revert(cb) is cb and type(cb[1]) is nn.BatchNorm2d
    assert cb[1] is not model[1]._bnswap_original[0] and not bnswap.is_swapped(cb[1])
    assert cb[1].weight is not model[1].weight and torch.equal(cb[1].weight, cs[1].weight)
    assert torch.equal(cs(x), cb(x))
    assert_same_state(cs, cb)
    assert bnswap.revert(model) is model and type(model[1]) is nn.BatchNorm2d
