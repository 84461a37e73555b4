"""pt2e quantization-aware training (torchao) of the main job's MobileNetV2-style net on
scikit-learn's digits, once on stock ``nn.BatchNorm2d`` and once after ``bnswap.convert``.

The flow of pytorch issue 111384: train the float model, export it on the CPU
(``torch.export``), ``prepare_qat_pt2e`` (XNNPACK's quantizer), train the prepared graph
(``--device cuda`` where there is one), ``move_exported_model_to_eval``, ``convert_pt2e``
(on the CPU), and print the float model's validation accuracy next to the int8 one.
Both prepared graphs are stock's, ``aten.batch_norm``, which picks its kernel when it
runs (its ``cudnn_enabled`` argument is read by no torch release: cuDNN on CUDA where
torch's rule allows): bnswap hands torchao stock's ops and puts nothing back
(docs/qat.md). On the CPU both runs give the same figures, bit for bit.

    python examples/qat_pt2e.py                          # both runs on the CPU
    python examples/qat_pt2e.py --device cuda            # QAT of the prepared graphs on a GPU
    python examples/qat_pt2e.py --epochs 1 --qat_epochs 1 --limit 5   # a smoke run
"""

from __future__ import annotations

import collections
import time
import warnings

import torch
from torch import nn
from torch.nn import functional as F

import bnswap
from bnswap.app.digits import digits_split
from bnswap.app.models import MobileNetV2


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str = "cpu") -> float:
    """Validation accuracy of ``model`` (an eager module or a graph) on (N, 1, H, W) ``x``."""
    with torch.no_grad():
        logits = torch.cat([model(xb.to(device)).cpu() for xb in x.split(256)])
    return (logits.argmax(1) == y).float().mean().item()


def fit(
    model: nn.Module,
    xt: torch.Tensor,
    yt: torch.Tensor,
    epochs: int,
    lr: float,
    limit: int | None,
    seed: int,
    device: str,
    batch_size: int = 64,
) -> None:
    """SGD with a cosine schedule over ``epochs`` (``limit``: batches per epoch at most)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    steps = len(yt) // batch_size if limit is None else min(limit, len(yt) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, epochs * steps))
    for epoch in range(epochs):
        order = torch.randperm(len(yt), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(steps):
            idx = order[i * batch_size : (i + 1) * batch_size]
            loss = F.cross_entropy(model(xt[idx].to(device)), yt[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()


def run(
    swap: bool,
    epochs: int,
    qat_epochs: int,
    limit: int | None,
    width_mult: float,
    device: str,
    seed: int = 0,
) -> dict:
    """One run: float training, export, QAT, convert; its figures and final state."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    (xt, yt), (xv, yv) = digits_split(16, seed=seed)
    torch.manual_seed(seed)
    model = MobileNetV2(width_mult=width_mult)
    if swap:
        bnswap.convert(model)
    t0 = time.perf_counter()
    fit(model.to(device), xt, yt, epochs, 0.1, limit, seed, device)
    float_acc = accuracy(model.eval(), xv, yv, device)
    # export on the CPU, as the issue's flow does, then train the prepared graph on device
    batch = {0: torch.export.Dim("batch", min=1)}  # training and validation batch sizes
    graph = torch.export.export(model.cpu().train(), (xt[:64],), dynamic_shapes=(batch,)).module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!" (torchao 0.18)
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
    prepared = prepare_qat_pt2e(graph, quantizer)
    ops = collections.Counter(
        str(n.target).split(".")[1]
        for n in prepared.graph.nodes
        if n.op == "call_function" and "batch_norm" in str(n.target)
    )
    fit(prepared.to(device), xt, yt, qat_epochs, 0.01, limit, seed + 100, device)
    move_exported_model_to_eval(prepared)
    qat_acc = accuracy(prepared, xv, yv, device)
    quantized = convert_pt2e(prepared.cpu())
    int8_acc = accuracy(quantized, xv, yv)
    return {
        "float_acc": float_acc,
        "qat_acc": qat_acc,
        "int8_acc": int8_acc,
        "batch_norm_ops": dict(ops),
        "seconds": time.perf_counter() - t0,
        "logits": torch.cat([quantized(xb) for xb in xv.split(256)]),
        "state": {k: v.detach().cpu().clone() for k, v in prepared.state_dict().items()},
    }


def main(
    epochs: int = 3,
    qat_epochs: int = 2,
    limit: int | None = None,
    width_mult: float = 0.5,
    device: str = "cpu",
    num_threads: int | None = 1,
) -> dict:
    """Run stock, then bnswap, and print the float and int8 validation accuracies.

    Args:
        epochs: float training epochs before export.
        qat_epochs: epochs of quantization-aware training of the prepared graph.
        limit: training batches per epoch at most (None: the whole training split).
        width_mult: MobileNetV2 width multiplier.
        device: where both trainings run (``cuda`` where there is one); export and
            convert_pt2e run on the CPU.
        num_threads: ``torch.set_num_threads`` (None: torch's default).
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    runs = {
        "stock": run(False, epochs, qat_epochs, limit, width_mult, device),
        "bnswap": run(True, epochs, qat_epochs, limit, width_mult, device),
    }
    for name, r in runs.items():
        print(
            f"{name:>6}: float val_acc {r['float_acc']:.4f}  QAT val_acc {r['qat_acc']:.4f}  "
            f"int8 val_acc {r['int8_acc']:.4f}  prepared graph's batch norm: "
            f"{r['batch_norm_ops']}  ({r['seconds']:.1f} s)"
        )
    s, b = runs["stock"], runs["bnswap"]
    same = torch.equal(s["logits"], b["logits"]) and all(
        torch.equal(s["state"][k], b["state"][k]) for k in s["state"]
    )
    print(f"int8 logits and final QAT states bitwise identical: {same}")
    return {**runs, "identical": same}


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
