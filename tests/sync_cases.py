"""Synchronized BatchNorm cases for tests/test_sync.py, run on real gloo processes.

``python tests/sync_cases.py WORLD_SIZE OUT_DIR`` spawns WORLD_SIZE processes
(``torch.multiprocessing.spawn``, gloo on 127.0.0.1, a free port); every rank runs every
case of its world size in ONE process group and saves what it saw to
``OUT_DIR/rank{r}.pt``; the test compares those records with one process running stock
``nn.BatchNorm`` on the concatenation of every rank's batch. Each rank builds every rank's
batch from the same seed and keeps its own slice.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _helpers import COLLECTIVE_TIMEOUT_S
from torch import nn

#: (case, layer kwargs, class, per-rank batch sizes of each step, feature shape, dtype,
#: channels_last) per world size.
CASES = {
    2: [
        (
            "f64_2d",
            dict(num_features=3),
            nn.BatchNorm2d,
            [[3, 1], [4, 0], [2, 5]],
            (3, 4, 4),
            torch.float64,
            False,
        ),
        (
            "f64_1d_cma_noaffine",
            dict(num_features=4, momentum=None, affine=False),
            nn.BatchNorm1d,
            [[2, 3], [0, 5], [1, 1]],
            (4, 6),
            torch.float64,
            False,
        ),
        (
            "f64_no_tracking",
            dict(num_features=3, track_running_stats=False),
            nn.BatchNorm2d,
            [[2, 2], [3, 0]],
            (3, 2, 2),
            torch.float64,
            False,
        ),
        (
            "f32_2d_cl",
            dict(num_features=5),
            nn.BatchNorm2d,
            [[4, 2], [3, 6]],
            (5, 4, 3),
            torch.float32,
            True,
        ),
        # float32 NCHW: ATen's CPU kernels in the statistics and backward slots
        (
            "f32_2d",
            dict(num_features=4),
            nn.BatchNorm2d,
            [[5, 3], [2, 6], [0, 4]],
            (4, 5, 5),
            torch.float32,
            False,
        ),
    ],
    3: [
        (
            "f64_2d",
            dict(num_features=3),
            nn.BatchNorm2d,
            [[2, 0, 3], [1, 4, 2], [0, 0, 3]],
            (3, 3, 2),
            torch.float64,
            False,
        ),
        (
            "f64_3d_cma",
            dict(num_features=2, momentum=None),
            nn.BatchNorm3d,
            [[1, 2, 1], [2, 0, 2]],
            (2, 2, 2, 2),
            torch.float64,
            False,
        ),
        ("f32_1d", dict(num_features=4), nn.BatchNorm1d, [[5, 3, 4]], (4,), torch.float32, False),
    ],
}


def batches(case: str, sizes: list[int], feature: tuple, dtype: torch.dtype, step: int):
    """Every rank's input and output gradient of one step (the same on every rank)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}:{step}".encode()))
    xs = [
        torch.randn((n, *feature), generator=g, dtype=torch.float64).mul(3).add(2).to(dtype)
        for n in sizes
    ]
    dys = [torch.randn((n, *feature), generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    return xs, dys


def _init_params(layer: nn.Module, case: str) -> None:
    g = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        if layer.weight is not None:
            layer.weight.copy_(torch.rand(layer.weight.shape, generator=g) + 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))


def _state(layer: nn.Module) -> dict:
    return {
        k: (None if v is None else v.detach().clone())
        for k, v in [
            ("running_mean", layer.running_mean),
            ("running_var", layer.running_var),
            ("num_batches_tracked", layer.num_batches_tracked),
        ]
    }


def run_case(rank: int, world: int, spec) -> dict:
    import bnswap

    case, kwargs, cls, steps, feature, dtype, channels_last = spec
    bn = cls(**kwargs).to(dtype)
    _init_params(bn, case)
    params = [p for p in bn.parameters()]
    model = bnswap.convert(nn.Sequential(bn), sync_batchnorm=True)
    layer = model[0]
    assert type(layer) is nn.SyncBatchNorm and bnswap.is_swapped(layer)
    assert [p for p in layer.parameters()] == params  # the same Parameter objects
    records = []
    for i, sizes in enumerate(steps):
        xs, dys = batches(case, sizes, feature, dtype, i)
        x = xs[rank].clone().requires_grad_(True)
        if channels_last:
            x = x.detach().to(memory_format=torch.channels_last).requires_grad_(True)
        for p in params:
            p.grad = None
        out = model(x)
        out.backward(dys[rank])
        records.append(
            dict(
                out=out.detach().clone(),
                grad=x.grad.clone(),
                pgrads=[p.grad.clone() for p in params],
                cl=out.is_contiguous(memory_format=torch.channels_last),
                state=_state(layer),
            )
        )
    # evaluation: exactly the unsynchronized path, bitwise equal to stock BatchNorm
    model.eval()
    xs, _ = batches(case, [3] * world, feature, dtype, 99)
    evaluated = model(xs[rank]).detach()
    back = bnswap.revert(model)
    return dict(
        records=records,
        eval=evaluated,
        eval_input=xs[rank],
        reverted=back[0] is bn and type(bn) is cls and not bnswap.is_swapped(bn),
        final=_state(bn),
        final_params=[p.detach().clone() for p in params],
    )


#: The cases also run with the CUDA slots (``bnswap.sync.DEVICE_KERNELS["cuda"]``) on the
#: CPU, their two CUDA-only kernels replaced by :func:`cuda_kernel_references`.
CUDA_SLOT_CASES = ("f64_2d", "f32_2d_cl")


def cuda_kernel_references(calls: dict) -> dict:
    """``torch.batch_norm_backward_reduce`` / ``batch_norm_backward_elemt`` as their CUDA
    kernels compute them (aten/src/ATen/native/cuda/Normalization.cuh), in torch ops for
    CPU tensors, counting their calls in ``calls``: no CUDA here, so this runs the wiring
    of bnswap's CUDA slots (argument order, which sums, the int32 counts), not the
    kernels."""

    def view(t, x):
        return t.view(1, -1, *([1] * (x.dim() - 2)))

    def backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        calls["backward_reduce"] = calls.get("backward_reduce", 0) + 1
        dims = [0, *range(2, x.dim())]
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * (x - view(mean, x))).sum(dims)
        return (
            sum_dy if input_g else None,
            sum_dy_xmu if input_g else None,
            sum_dy_xmu * invstd if weight_g else None,
            sum_dy if bias_g else None,
        )

    def backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        calls["backward_elemt"] = calls.get("backward_elemt", 0) + 1
        if count.dtype != torch.int32:  # the kernel reads int32 counts
            raise RuntimeError(f"count must be int32, got {count.dtype}")
        n = int(count.sum())
        w = torch.ones_like(mean) if weight is None else weight
        return (
            dy
            - view(sum_dy / n, x)
            - (x - view(mean, x)) * view(sum_dy_xmu / n * invstd * invstd, x)
        ) * view(invstd * w, x)

    return {
        "batch_norm_backward_reduce": backward_reduce,
        "batch_norm_backward_elemt": backward_elemt,
    }


def cuda_slots_cases(rank: int, world: int) -> dict:
    """:data:`CUDA_SLOT_CASES` with the CPU's slots replaced by the CUDA ones."""
    from unittest import mock

    from bnswap import sync

    calls: dict = {}
    refs = cuda_kernel_references(calls)
    with (
        mock.patch.dict(sync.DEVICE_KERNELS, {"cpu": sync.DEVICE_KERNELS["cuda"]}),
        mock.patch.object(
            torch, "batch_norm_backward_reduce", refs["batch_norm_backward_reduce"], create=True
        ),
        mock.patch.object(
            torch, "batch_norm_backward_elemt", refs["batch_norm_backward_elemt"], create=True
        ),
    ):
        out = {
            spec[0]: run_case(rank, world, spec)
            for spec in CASES[world]
            if spec[0] in CUDA_SLOT_CASES
        }
    return {"cases": out, "calls": calls}


def compiled_case(rank: int) -> dict:
    """torch.compile(fullgraph=True, backend="aot_eager") of a synchronized model (any
    graph break raises) against eager, forward and backward, 2 steps."""
    import bnswap

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
        nn.BatchNorm1d(2, momentum=None),
    ).double()
    eager = bnswap.convert(net, sync_batchnorm=True)
    import copy

    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    out = {}
    for step, n in enumerate([3 + rank, 2 - rank]):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64)
        a = eager(x)
        b = compiled(x)
        a.sum().backward()
        b.sum().backward()
        out[f"out{step}"] = (a.detach(), b.detach())
    out["grads"] = [
        (p.grad, q.grad) for p, q in zip(eager.parameters(), twin.parameters(), strict=True)
    ]
    out["state"] = [
        (s, t) for s, t in zip(eager.state_dict().values(), twin.state_dict().values(), strict=True)
    ]
    return out


def errors_case(rank: int, world: int) -> dict:
    """One value per channel in the global batch; a process group without this rank."""
    import bnswap

    out: dict = {}
    layer = bnswap.convert(nn.Sequential(nn.BatchNorm1d(3)), sync_batchnorm=True)[0]
    before = _state(layer)
    x = torch.randn(1, 3) if rank == 0 else torch.randn(0, 3)
    try:
        layer(x)
        out["one_value"] = None
    except ValueError as e:
        out["one_value"] = str(e)
    out["one_value_state_same"] = all(torch.equal(before[k], v) for k, v in _state(layer).items())
    # a momentum that is no number: stock's TypeError before any collective or count (as
    # the unsynchronized path; it came after the all_gather and the count, and another text)
    layer.momentum = "a"
    try:
        layer(torch.randn(2, 3))
        out["momentum"] = None
    except TypeError as e:
        out["momentum"] = str(e)
    out["momentum_state_same"] = all(torch.equal(before[k], v) for k, v in _state(layer).items())
    layer.momentum = 0.1
    # all ranks empty: stock's early return (num_batches_tracked moves, statistics do not)
    y = layer(torch.randn(0, 3, requires_grad=True))
    out["all_empty"] = (tuple(y.shape), _state(layer))
    # a group with rank 0 only: rank 0 runs unsynchronized, the others get a clear error
    sub = dist.new_group([0])
    only0 = bnswap.convert(nn.BatchNorm1d(3), sync_batchnorm=True, process_group=sub)
    try:
        only0(torch.randn(4, 3))
        out["not_member"] = None
    except ValueError as e:
        out["not_member"] = str(e)
    out["plan_sync"] = [r.sync for r in bnswap.plan(nn.Sequential(only0, nn.SyncBatchNorm(2)))]
    out["no_counter"] = no_counter_case(rank)
    # DDP wraps a CPU module whose SyncBatchNorm layers are swapped, and still refuses a
    # stock one (torch's check: stock's kernels are CUDA-only)
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP(bnswap.convert(nn.Sequential(nn.Linear(2, 3), nn.SyncBatchNorm(3))))
    try:
        DDP(nn.Sequential(nn.Linear(2, 3), nn.SyncBatchNorm(3)))
        out["ddp_stock"] = None
    except ValueError as e:
        out["ddp_stock"] = str(e)
    return out


def no_counter_case(rank: int) -> dict:
    """A layer without num_batches_tracked (a torch 0.3-era whole-model pickle, issue 46)
    made synchronized: training with track_running_stats raises stock's AttributeError on
    every rank before any collective or state change; without tracking it synchronizes as
    the same layer with a counter does; eval is stock's."""
    import bnswap

    torch.manual_seed(5)
    x = torch.randn(3 + rank, 3)
    out: dict = {}
    for tracking in (True, False):
        layers = []
        for keep in (False, True):
            bn = nn.BatchNorm1d(3, track_running_stats=tracking)
            if not keep:
                del bn.num_batches_tracked
            layers.append(bnswap.convert(nn.Sequential(bn), sync_batchnorm=True)[0])
        old, ref = layers
        try:
            out[tracking] = torch.equal(old(x), ref(x))
        except AttributeError as e:
            out[tracking] = f"{e}; state same: {torch.equal(old.running_mean, torch.zeros(3))}"
    stock = nn.BatchNorm1d(3).eval()
    del stock.num_batches_tracked
    swapped = bnswap.convert(nn.Sequential(copy.deepcopy(stock)), sync_batchnorm=True)[0]
    out["eval"] = torch.equal(swapped.eval()(x), stock(x))
    return out


def bad_input_case(rank: int) -> dict:
    """Rank 1 gets an input with the wrong channel count, rank 0 a good one: rank 1 raises
    stock's error before any collective; rank 0 must not wait forever."""
    import bnswap

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    layer = bnswap.convert(nn.BatchNorm2d(3), sync_batchnorm=True, process_group=group)
    x = torch.randn(2, 3 if rank == 0 else 4, 2, 2)
    try:
        layer(x)
        return dict(error=None, nbt=int(layer.num_batches_tracked))
    except Exception as e:  # recorded for the test
        return dict(error=f"{type(e).__name__}: {e}", nbt=int(layer.num_batches_tracked))


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    result: dict = {}
    try:
        result["cases"] = {spec[0]: run_case(rank, world, spec) for spec in CASES[world]}
        if world == 2:
            result["cuda_slots"] = cuda_slots_cases(rank, world)
            result["compiled"] = compiled_case(rank)
            result["errors"] = errors_case(rank, world)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        if world == 2:
            # last: the failing rank leaves the group; the good rank's collective must end
            # with an error, not wait forever
            result["bad_input"] = bad_input_case(rank)
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            if rank == 1:
                os._exit(0)  # leaves without joining the collective rank 0 waits in
    except Exception:
        traceback.print_exc()
        raise
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    mp.spawn(worker, args=(world, free_port(), out_dir), nprocs=world)
