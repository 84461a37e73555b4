"""One order of ``torch.compile`` / ``Module.compile()`` / ``bnswap.convert`` / ``revert`` /
``torch._dynamo.reset()`` in this fresh interpreter (tests/test_compile_orders.py runs it):
``python tests/compile_orders.py ORDER BACKEND``. Prints one JSON line per step: the
batch-norm ops of the graphs that ran in it (recorded by the backend itself), dynamo's
frame count so far, and digests (sha256 of the bytes) of the output, the gradients and
the running statistics, so that two processes compare bit for bit.

BACKEND ``aot_eager``: ``aot_eager``'s own pieces (AOT autograd, the graphs run as they
are), with the forward and backward graphs' batch-norm ops recorded when they run.
BACKEND ``inductor``: inductor itself, with the batch-norm calls of the graph dynamo
hands it recorded when it runs. ``bnswap`` is imported only where the order says so.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

RAN: list[str] = []


def _bn_ops(gm: torch.fx.GraphModule) -> list[str]:
    found = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.nn.functional.batch_norm:
            found.add("F.batch_norm")
        elif "batch_norm" in str(n.target):
            found.add(str(n.target).replace("aten.", "").replace(".default", ""))
    return sorted(found)


CODE: list[str] = []


def _recording(fn: Any, gm: torch.fx.GraphModule) -> Any:
    ops, code = _bn_ops(gm), hashlib.sha256(gm.code.encode()).hexdigest()[:12]

    def run(*args: Any) -> Any:
        RAN.extend(ops)
        CODE.append(code)
        return fn(*args)

    return run


def _aot_part(gm: torch.fx.GraphModule, _: Any) -> Any:
    return make_boxed_func(_recording(gm.forward, gm))


def _inductor(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx

    return _recording(compile_fx(gm, example_inputs), gm)


BACKENDS = {
    "aot_eager": aot_autograd(fw_compiler=_aot_part, bw_compiler=_aot_part),
    "inductor": _inductor,
}


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
    )


class User(nn.Module):
    """A user's model: its forward is the user's code (dynamo compiles it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * 2


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def step(name: str, call: Any, model: nn.Module) -> None:
    """One training step of ``model`` through ``call``; prints its JSON line."""
    RAN.clear()
    CODE.clear()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    y = call(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    stats = [b for n, b in model.named_buffers() if "running" in n]
    print(
        json.dumps(
            {
                "step": name,
                "ran": sorted(set(RAN)),
                "code": CODE[:],
                "graphs": counters["stats"]["unique_graphs"],
                "out": _digest(y),
                "grads": _digest(*(p.grad for p in model.parameters())),
                "stats": _digest(*stats),
            }
        ),
        flush=True,
    )


def main(order: str, backend_name: str) -> None:
    backend = BACKENDS[backend_name]
    compiled = lambda m: torch.compile(m, backend=backend)  # noqa: E731
    if order == "stock":  # the reference: bnswap never imported
        m = User()
        step("user", compiled(m), m)
        step("user", compiled(m), m)
        return
    if order.startswith("neighbours"):
        # torch's own modules compiled whole: dynamo runs them eagerly (torch.nn is skipped)
        if order == "neighbours_after_swap":
            import bnswap

            bnswap.convert(nn.BatchNorm2d(1))
        seq, bn = net(), nn.BatchNorm2d(3)
        seq.compile(backend=backend)
        bn.compile(backend=backend)
        step("sequential", seq, seq)
        step("batchnorm", bn, bn)
        step("sequential", seq, seq)
        assert "bnswap" in sys.modules or order == "neighbours", order
        return

    import bnswap

    if order == "user_after_swap":  # a model bnswap never touched, beside a swapped one
        bnswap.convert(User())
        m = User()
        step("user", compiled(m), m)
        step("user", compiled(m), m)
    elif order == "compiled_then_converted":  # the same compiled model, converted after
        m = User()
        cm = compiled(m)
        step("stock", cm, m)
        bnswap.convert(m)
        step("converted", cm, m)
    elif order == "neighbour_compiled_then_new_converted":  # another model compiled first
        s = User()
        step("stock", compiled(s), s)
        m = bnswap.convert(User())
        step("converted", compiled(m), m)
        step("stock again", compiled(s), s)
    elif order == "module_compile_then_converted":  # nn.Module.compile(), then convert
        m = User()
        m.compile(backend=backend)
        step("stock", m, m)
        bnswap.convert(m)
        step("converted", m, m)
    elif order == "converted_reverted_reset":  # convert, compile, revert, convert, reset
        m = bnswap.convert(User())
        cm = compiled(m)
        step("converted", cm, m)
        bnswap.revert(m)
        step("reverted", cm, m)
        bnswap.convert(m)
        step("converted again", cm, m)
        torch._dynamo.reset()
        step("after reset", cm, m)
    else:
        raise SystemExit(f"unknown order {order!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(sys.argv[1], sys.argv[2])
    for w in caught:
        if "bnswap" in str(w.message) and "compiled" in str(w.message):
            print(json.dumps({"warning": str(w.message), "category": w.category.__name__}))
