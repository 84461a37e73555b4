"""Which kernel a batch-norm node of a graph runs: now (``kernel_before``), and once
:func:`bnswap.programs.convert` has rewritten it (``kernel_after``). The node's arguments
(their shape and dtype metadata, ``node.meta["val"]``) read as a :class:`bnswap.kernels.Call`
and handed to torch's rule (:func:`bnswap.kernels.op_kernel`): the program road's kernel
columns, as :func:`bnswap.kernels.layer_kernel` is the module road's."""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from bnswap import kernels
from bnswap._graph import _BACKWARD, CONSOLIDATED_TARGETS, _forward_of, stock_call

__all__ = ["kernel_after", "kernel_before"]


def _float(arg: object) -> float:
    """A node's ``float eps`` argument: a literal in every graph torch records."""
    assert isinstance(arg, (int, float)), arg
    return float(arg)


# The kernel columns: torch's rule (bnswap.kernels) on what each node passes, now and
# after convert.
_NO_SHAPE = "n/a (no shape metadata)"


def _tensor_of(arg: object) -> torch.Tensor | None:
    """The value of a graph argument: its ``meta["val"]``, or the tensor a ``get_attr``
    node names (a pt2e graph's parameters); None when there is none."""
    if not isinstance(arg, Node):
        return None
    val = arg.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val
    if arg.op == "get_attr" and isinstance(arg.target, str):
        owner: object = arg.graph.owning_module
        for part in arg.target.split("."):
            owner = getattr(owner, part, None)
        return owner if isinstance(owner, torch.Tensor) else None
    return None


def _dtype_of(arg: object, default: torch.dtype) -> torch.dtype | None:
    """A (C,) argument's dtype: None when not passed, ``default`` (the input's) when its
    value is not known."""
    if arg is None:
        return None
    t = _tensor_of(arg)
    return t.dtype if t is not None else default


#: A (C,) argument that is passed but has no value of its own in the graph: the dummy
#: bias ``batch_norm_backward``'s CUDA kernel selects with (``at::empty(1)``).
_DEFINED = object()


def _call(
    x: object,
    w: object,
    b: object,
    mean: object,
    var: object,
    training: object,
    eps: object,
    *,
    stand_ins: bool = False,
) -> kernels.Call | None:
    """What torch's selection sees of a node's arguments (None without the input's shape
    metadata); ``stand_ins``: as :func:`convert` makes them for a consolidated op (a
    missing weight / bias / statistics made like the first (C,) tensor, else like the
    input)."""
    xv = _tensor_of(x)
    if xv is None or xv.dim() < 2:
        return None
    call = kernels.Call.of(xv, None, None, None, None, training is not False, _float(eps))
    wd, bd, md = (_dtype_of(a, xv.dtype) for a in (w, b, mean))
    has_mean, has_var = mean is not None, var is not None
    if stand_ins:
        like = next((d for d in (wd, bd, md) if d is not None), xv.dtype)
        wd, bd, has_mean, has_var = wd or like, bd or like, True, True
    return dataclasses.replace(call, weight=wd, bias=bd, running_mean=has_mean, running_var=has_var)


def _args(node: Node, count: int) -> list[object]:
    """The node's first ``count`` arguments, positional or by the op's schema names."""
    args: list[object] = list(node.args[:count])
    schema = getattr(node.target, "_schema", None)
    if len(args) < count and schema is not None:
        args += [node.kwargs.get(a.name) for a in schema.arguments[len(args) : count]]
    return args + [None] * (count - len(args))


def _on(x: object, device: torch.device | None) -> torch.device | None:
    """``device``, else the device of the input ``x``'s value."""
    xv = _tensor_of(x)
    return device if device is not None else (xv.device if xv is not None else None)


def _kernel(
    target: object, x: object, call: kernels.Call | None, device: torch.device | None
) -> str:
    dev = _on(x, device)
    packet = getattr(target, "overloadpacket", target)
    if packet in kernels.NATIVE_OPS or packet in kernels.CPU_ONLY_OPS:
        return kernels.op_kernel(target, call, dev if dev is not None else "cpu")
    if call is None or dev is None:
        return _NO_SHAPE
    return kernels.op_kernel(target, call, dev)


def kernel_before(node: Node, device: torch.device | None) -> str:
    """The kernel ``node`` runs as it is, on ``device`` (default: its input's):
    :func:`bnswap.kernels.op_kernel` on its own arguments. Stock's ``aten.batch_norm``
    selects at run time whatever its ``cudnn_enabled`` says."""
    target = node.target
    if target is _BACKWARD:
        return _kernel(target, _args(node, 2)[1], None, device)
    if target is torch.ops.aten.batch_norm_backward.default:
        _, x, w, mean, var, _, _, _, eps = _args(node, 9)
        return _kernel(target, x, _call(x, w, _DEFINED, mean, var, True, eps), device)
    if target in CONSOLIDATED_TARGETS:  # (x, w, b, mean, var, momentum, eps)
        x, w, b, mean, var, _, eps = _args(node, 7)
        return _kernel(target, x, _call(x, w, b, mean, var, True, eps), device)
    found = stock_call(node)
    if found is None:
        return "-"
    x, w, b, mean, var, training, _, eps = found[0]
    return _kernel(target, x, _call(x, w, b, mean, var, training, eps), device)


def kernel_after(node: Node, target: object, device: torch.device | None) -> str:
    """The kernel ``node`` runs once :func:`convert` has made it a ``target`` node: the
    consolidated forward ops with the stand-ins convert adds, ``batch_norm_backward``
    with its forward's weight (or stand-in), any other op with the node's arguments."""
    aten = torch.ops.aten
    packet = getattr(target, "overloadpacket", target)
    if packet is aten.batch_norm_backward:  # (grad, x, w, mean, var, save_mean,
        # save_invstd, train, eps, mask) -> the same with the forward's weight
        _, x, _, mean, var, _, _, _, eps = _args(node, 9)
        fwd = _forward_of(node)
        found = stock_call(fwd) if fwd is not None else None
        if found is None:
            return "-"
        fx, fw, fb, fmean = found[0][:4]
        forward = _call(fx, fw, fb, fmean, fmean, True, eps, stand_ins=True)
        call = _call(x, _DEFINED, _DEFINED, mean, var, True, eps)
        if call is not None and forward is not None:
            call = dataclasses.replace(call, weight=forward.weight)
        return _kernel(target, x, call, device)
    found = stock_call(node)
    if found is None:
        return kernel_before(node, device)
    x, w, b, mean, var, training, _, eps = found[0]
    stand_ins = packet in (aten._batch_norm_with_update, aten._batch_norm_with_update_functional)
    return _kernel(target, x, _call(x, w, b, mean, var, training, eps, stand_ins=stand_ins), device)
