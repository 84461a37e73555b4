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

import higher
import torch
from torch import nn

import bnswap


def build() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                      nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 1))
    m(torch.randn(8, 5))   # statistics of its own, not the initial ones
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
    update_module(learner, 0.1, {id(p): g for p, g in zip(params, grads)})
    query = learner(data(2)).square().mean()
    return query.detach(), list(torch.autograd.grad(query, list(model.parameters())))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
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
    adapter = swapped[1].forward.adapter
    monkeypatch.setattr(swapped[1].forward, "adapter",
                        lambda m, *a, **k: seen.append(m) or adapter(m, *a, **k))
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


def test_maml_step_through_higher_equals_stock():
    stock, swapped = pair()
    loss_a, grads_a, _ = higher_step(stock)
    loss_b, grads_b, rows = higher_step(swapped)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert_same_state(stock, swapped)
    # higher's patched class overrides forward: plan leaves it (it runs that forward)
    assert [r.action for r in rows] == ["skip", "skip"]
    assert all("overrides forward" in r.reason and "higher" in r.reason for r in rows)


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
            setattr(r, key, p * 1)   # non-leaf, differentiable to the original
        for key, b in m._buffers.items():
            if b is not None:
                setattr(r, key, b.clone())
    return copies[model]


def test_dataparallel_replica_equals_stock():
    stock, swapped = pair()
    ra, rb = replica(stock), replica(swapped)
    for r in (ra, rb):
        r(data(3)).square().mean().backward()
    assert_same_state(ra, rb)                  # the replicas' own statistics moved
    assert_same_state(stock, swapped)          # the originals' did not (alike)
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
