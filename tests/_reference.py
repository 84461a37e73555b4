"""Side-by-side stock vs bnswap helpers for the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

import bnswap


def pair(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(stock layer, converted deepcopy), identical state."""
    swapped = copy.deepcopy(layer)
    bnswap.convert(swapped)
    return layer, swapped


def step(stock: nn.Module, swapped: nn.Module, x: torch.Tensor, grad_seed: int = 1):
    """One forward+backward on identical inputs; returns (y1, y2, gx1, gx2)."""
    x1 = x.detach().clone().requires_grad_(x.is_floating_point())
    x2 = x.detach().clone().requires_grad_(x.is_floating_point())
    y1, y2 = stock(x1), swapped(x2)
    g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y1.dtype)
    if y1.requires_grad:
        y1.backward(g)
        y2.backward(g)
    return y1, y2, x1.grad, x2.grad


def assert_state_equal(a: nn.Module, b: nn.Module, exact: bool = True, **tol) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if exact:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], **tol, msg=k)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        if pa.grad is None:
            assert pb.grad is None, na
        elif exact:
            assert torch.equal(pa.grad, pb.grad), na
        else:
            torch.testing.assert_close(pa.grad, pb.grad, **tol, msg=na)
