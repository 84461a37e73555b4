"""The synchronized layer's global batch, rank by rank: what each rank computes between
the two collectives, on the device's own kernels where they take the tensors, and the
collectives themselves, in one autograd Function (:class:`_SyncBatchNorm`), which
:func:`bnswap.sync.synchronized_batch_norm` applies.

Each rank's steps are named functions, so they run (and are tested) without a process
group: :func:`rank_stats` (this rank's count, mean and biased variance, packed for the
all_gather), :func:`global_stats` (Chan et al.'s combination of the gathered rows),
:func:`rank_output` (the normalization with the global statistics: stock's evaluation
call, ``aten.batch_norm``, which has a kernel on every device); backward,
:func:`rank_sums` (the two per-channel sums, summed over the ranks by one collective) and
:func:`rank_input_grad`. The device's kernels fill three slots (:class:`Slots`,
:data:`DEVICE_KERNELS`); elsewhere, and in code being compiled, the portable torch ops
run. Why the formulation is what it is, and what each choice costs: ``docs/design.md``,
"Synchronized BatchNorm". With :mod:`bnswap.sync`, the only module that runs collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEVICE_KERNELS",
    "ONE_VALUE_MESSAGE",
    "SYNC_KERNEL",
    "GlobalStats",
    "RankStats",
    "Slots",
    "global_stats",
    "rank_input_grad",
    "rank_output",
    "rank_stats",
    "rank_sums",
    "sync_kernel",
]

#: What the plan's kernel column says a synchronized layer runs in training.
SYNC_KERNEL = "Sync (portable)"


def _funcol() -> Any:
    # Imported with the first synchronized forward: torch.distributed itself may lack it
    # (a torch built without distributed support), where no group can be initialized.
    import torch.distributed._functional_collectives as funcol

    return funcol


def _wait(t: Tensor) -> Tensor:
    # Functional collectives return an AsyncCollectiveTensor in eager (a subclass that
    # waits on first use); wait once here, so the ops after it run on a plain tensor.
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


_native_backward = torch.ops.aten.native_batch_norm_backward.default

#: Input dtypes whose statistics are computed in their own dtype; float16 / bfloat16 input
#: is computed in float32 (torch's opmath type for them, what stock's kernels accumulate in).
_FULL = frozenset((torch.float32, torch.float64))


def _normalize(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` per channel, on stock's evaluation
    call (``aten::batch_norm`` with ``training=False``: cuDNN / MIOpen / native, picked
    when it runs, on every device)."""
    return torch.batch_norm(
        x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled
    )


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: Tensor, x: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class Slots(NamedTuple):
    """A device's own kernels in the three per-device slots of the synchronized
    formulation (eager mode). Each slot returns None where its kernel does not take the
    tensors, and the portable torch ops run instead.

    * ``stats(x)``: this rank's per-channel (mean, biased variance), two (C,) tensors
      in ``x``'s dtype, of non-empty float32 / float64 ``x`` ``(N, C, *)``;
    * ``sums(dy, x, mean, invstd, weight)``: this rank's per-channel ``(sum(dy),
      sum(dy * (x - mean)))``, two (C,) tensors, for ``dy`` and ``x`` ``(N, C, *)``, the
      global ``mean`` and ``invstd`` (C,) and ``weight`` (C,) or None;
    * ``input_grad(dy, x, mean, invstd, weight, sums, counts, n)``: the input gradient
      ``(N, C, *)`` from ``sums``, the (2C,) ``sums`` added over every rank, ``counts``, the
      (R,) per-rank counts, and ``n``, their sum (a Python int);
    * ``label``: what the plan's kernel column says (:func:`sync_kernel`).

    They raise what their kernels raise (RuntimeError for a dtype a kernel refuses).

    Examples::

        >>> import torch
        >>> from bnswap.sync import DEVICE_KERNELS
        >>> cpu = DEVICE_KERNELS["cpu"]
        >>> cpu.label
        'Native'
        >>> x = torch.randn(4, 3, 5, 5)
        >>> mean, var = cpu.stats(x)  # ATen's batch_norm_update_stats
        >>> torch.allclose(var, x.var((0, 2, 3), unbiased=False))
        True
        >>> cpu.stats(x.to(memory_format=torch.channels_last)) is None  # portable ops
        True
    """

    label: str
    stats: Callable[[Tensor], tuple[Tensor, Tensor] | None]
    sums: Callable[..., tuple[Tensor, Tensor] | None]
    input_grad: Callable[..., Tensor | None]


def _cpu_kernel_layout(t: Tensor) -> bool:
    # ATen's CPU batch-norm kernels sum a channel of NCHW-contiguous input with more than
    # one value per (n, c) row by row, a vector sum per row added up in double; channels-
    # last input and (N, C) / (N, C, 1, ...) input take a per-thread float buffer summed
    # row after row instead, which loses the mean of float32 input at large means (mean
    # 1e4, std 1, 262144 values a channel: off by 9.5 std). Those take the portable ops.
    return t.is_contiguous() and t.numel() > t.shape[0] * t.shape[1]


def _cpu_stats(x: Tensor) -> tuple[Tensor, Tensor] | None:
    # the statistics kernel of training batch norm itself: the mean, then the squared
    # deviations from it, each summed in double for float32 input
    return torch.batch_norm_update_stats(x, None, None, 0.0) if _cpu_kernel_layout(x) else None


def _cpu_sums(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    if not (_cpu_kernel_layout(x) and _cpu_kernel_layout(dy)):
        return None
    # one fused pass over dy and x: the backward kernel's grad_bias is sum(dy), its
    # grad_weight sum(dy * (x - mean)) * invstd, here with invstd 1
    ones = torch.ones_like(mean)
    _, sum_dy_xmu, sum_dy = _native_backward(
        dy, x, ones, None, None, mean, ones, True, 0.0, [False, True, True]
    )
    return sum_dy, sum_dy_xmu


def _cpu_input_grad(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sums: Tensor,
    counts: Tensor,
    n: int,
) -> Tensor | None:
    if not (_cpu_kernel_layout(x) and _cpu_kernel_layout(dy)):
        return None
    # dx = (dy - sum_dy / n - (x - mean) invstd^2 sum_dy_xmu / n) scale is, per channel,
    # (x - mean) b + d + dy scale: two passes, the first on the evaluation normalization
    # kernel (variance 1, eps 0: it computes x b + (d - mean b), as it rounds the
    # forward's normalization), then one addcmul_
    c = mean.numel()
    scale = invstd if weight is None else torch.mul(invstd, weight)
    neg = scale.mul(-1.0 / n)
    d = torch.mul(sums.narrow(0, 0, c), neg)
    b = torch.mul(sums.narrow(0, c, c), invstd).mul_(invstd).mul_(neg)
    grad_input = _normalize(x, b, d, mean, torch.ones_like(mean), 0.0)
    return grad_input.addcmul_(dy, _channel_view(scale, dy))


def _cuda_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    # batch_norm_stats's kernel with the biased variance as its transform (stock's
    # batch_norm_stats gives 1 / sqrt(var + eps), from which M2 would come back rounded)
    return torch.batch_norm_update_stats(x, None, None, 0.0)


def _stock_grad_layout(dy: Tensor) -> Tensor:
    # stock's SyncBatchNorm backward hands its CUDA kernels a contiguous or channels-last
    # output gradient (an expanded one, from out.sum().backward(), becomes contiguous)
    if (
        dy.is_contiguous()
        or dy.is_contiguous(memory_format=torch.channels_last)
        or dy.is_contiguous(memory_format=torch.channels_last_3d)
    ):
        return dy
    return dy.contiguous()


def _cuda_sums(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None
) -> tuple[Tensor, Tensor]:
    sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
        _stock_grad_layout(dy), x, mean, invstd, weight, True, False, False
    )
    return sum_dy, sum_dy_xmu


def _cuda_input_grad(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sums: Tensor,
    counts: Tensor,
    n: int,
) -> Tensor:
    c = mean.numel()
    # the kernel divides by the sum of the per-rank counts, int32 as stock saves them
    return torch.batch_norm_backward_elemt(
        _stock_grad_layout(dy),
        x,
        mean,
        invstd,
        weight,
        sums.narrow(0, 0, c),
        sums.narrow(0, c, c),
        counts.to(torch.int32),
    )


#: Device types whose own batch-norm kernels fill the per-device slots of the formulation
#: in eager mode (:class:`Slots`): ``"cpu"``, ATen's native CPU kernels
#: (``batch_norm_update_stats``, the statistics kernel of training batch norm itself;
#: ``native_batch_norm_backward`` for the two sums; the evaluation ``batch_norm`` and one
#: ``addcmul_`` for the input gradient), for NCHW-contiguous input
#: (:func:`_cpu_kernel_layout`); ``"cuda"``, stock SyncBatchNorm's CUDA kernels
#: (``batch_norm_stats``'s kernel, reached through ``batch_norm_update_stats``;
#: ``batch_norm_backward_reduce``; ``batch_norm_backward_elemt``). The global combination
#: stays in torch ops on every device: ``batch_norm_gather_stats_with_counts`` divides by
#: ``n + count``, 0 for an empty first rank (a NaN), which is why stock masks empty ranks
#: with a data-dependent index (pytorch issue 156680). Other devices, code being compiled
#: (inductor fuses the portable ops itself) and parameters in another dtype than the
#: statistics run the portable torch ops.
DEVICE_KERNELS: dict[str, Slots] = {
    "cpu": Slots("Native", _cpu_stats, _cpu_sums, _cpu_input_grad),
    "cuda": Slots("SyncBatchNorm's CUDA kernels", _cuda_stats, _cuda_sums, _cuda_input_grad),
}


def sync_kernel(device: torch.device | str | None = None) -> str:
    """What the plan's kernel column says a layer synchronizing on ``device`` (default
    the CPU) runs in training: ``"Sync (Native)"`` on the CPU, ``"Sync (SyncBatchNorm's
    CUDA kernels)"`` on CUDA (:data:`DEVICE_KERNELS`), :data:`SYNC_KERNEL` (``"Sync
    (portable)"``) on any other device.

    Raises:
        RuntimeError: ``device`` is no device torch knows (``torch.device``'s error).

    Examples::

        >>> sync_kernel("cpu"), sync_kernel("meta")
        ('Sync (Native)', 'Sync (portable)')
    """
    slots = DEVICE_KERNELS.get(torch.device(device).type if device is not None else "cpu")
    return SYNC_KERNEL if slots is None else f"Sync ({slots.label})"


#: ``torch.distributed.all_gather_single`` (torch 2.13+).
_GATHER_INTO = getattr(dist, "all_gather_single", None)

#: Eager collectives as plain c10d calls (faster than the functional collectives, whose
#: tensor wrapper and wait cost more per call: ``benchmarks/bench_sync.py``); code being
#: compiled always takes the functional ones (traceable). Torch before 2.13 keeps the
#: functional ones in eager too: gloo's all_gather into one tensor is untested there.
_EAGER_C10D = _GATHER_INTO is not None

#: The backward's collective: ``"all_gather"`` of the (2C,) sums, then their sum on every
#: rank, or ``"all_reduce"``: the same sums either way, on every rank.
_BACKWARD_COLLECTIVE = "all_gather"


def _profiled(name: str) -> Any:
    # a named span for the profiler (bench_sync's breakdown; anyone's trace), only while
    # one records: record_function costs microseconds even when no profiler runs
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _all_gather(t: Tensor, group: Any, world: int, compiling: bool) -> Tensor:
    """(world * t.numel(),): every rank's ``t``, in rank order."""
    if not compiling and _EAGER_C10D:
        out = t.new_empty(world * t.numel())
        assert _GATHER_INTO is not None  # _EAGER_C10D says so
        with _profiled("bnswap.sync.all_gather"):
            _GATHER_INTO(out, t, group=group)
        return out
    funcol = _funcol()
    # all_gather_single (torch 2.13+; all_gather_tensor, its older name, warns there)
    gather = getattr(funcol, "all_gather_single", None)
    if gather is None:
        gather = funcol.all_gather_tensor
    return _wait(gather(t, 0, group))


def _sum_over_ranks(t: Tensor, group: Any, world: int, compiling: bool) -> Tensor:
    """The sum over the group's ranks of ``t`` (1-D, a fresh tensor), equal on every
    rank."""
    if _BACKWARD_COLLECTIVE == "all_gather":
        # every rank adds the same rows in the same order
        return _all_gather(t, group, world, compiling).view(world, -1).sum(0)
    if not compiling and _EAGER_C10D:
        with _profiled("bnswap.sync.all_reduce"):
            dist.all_reduce(t, group=group)
        return t
    return _wait(_funcol().all_reduce(t, "sum", group))


class RankStats(NamedTuple):
    """One rank's share of the forward before the collective (:func:`rank_stats`)."""

    #: ``input`` in the accumulation dtype (float32 for half input), ``(N, C, *)``
    x: Tensor
    #: (2C + 1,): this rank's count ``n_i``, per-channel mean and biased variance
    packed: Tensor
    #: the device kernels of the slots (None: the portable ops)
    slots: Slots | None
    #: weight and bias are in the accumulation dtype (the device kernels take them)
    params_acc: bool


class GlobalStats(NamedTuple):
    """The global batch's statistics, equal on every rank (:func:`global_stats`)."""

    #: (C,) mean and biased variance of the global batch, in the accumulation dtype
    mean: Tensor
    var: Tensor
    #: (C,) ``1 / sqrt(var + eps)``
    invstd: Tensor
    #: (C,) unbiased variance ``M2 / (n - 1)``, for running_var
    unbiased: Tensor
    #: the global count: an int in eager mode, a 0-dim tensor in code being compiled
    total: Tensor | int
    #: (R,) the per-rank counts
    counts: Tensor
    #: ``max(total, 1)``: the divisor of the backward's means
    n: Tensor | int


def rank_stats(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, compiling: bool
) -> RankStats:
    """This rank's per-channel count, mean and biased variance of ``input`` ``(N, C, *)``
    (N may be 0), packed as the (2C + 1,) tensor every rank all-gathers: the device's
    statistics kernel where it takes the tensors (:class:`Slots`, eager), else two
    portable passes."""
    x = input if input.dtype in _FULL else input.float()
    acc = x.dtype
    c = x.shape[1]
    count = x.numel() // c if c else 0
    params_acc = (weight is None or weight.dtype == acc) and (bias is None or bias.dtype == acc)
    slots = None if compiling or not params_acc else DEVICE_KERNELS.get(x.device.type)
    stats = slots.stats(x) if slots is not None and count else None
    if stats is not None:
        mean, var = stats
    elif count:
        # two passes (the mean, then squared deviations from it): as accurate as
        # Welford's torch.var_mean and 2-7x faster on CPU for (N, C, H, W) input
        dims = _reduce_dims(x)
        mean = x.mean(dims)
        dev = x - _channel_view(mean, x)
        var = (dev * dev).mean(dims)
    else:  # an empty rank: n_i = 0 adds nothing to the global sums
        mean = var = x.new_zeros(c)
    packed = torch.cat([mean.new_full((1,), count), mean, var])
    return RankStats(x, packed, slots, params_acc)


def global_stats(
    gathered: Tensor, eps: float, compiling: bool, size: torch.Size, group: Any
) -> GlobalStats:
    """The global batch's statistics from ``gathered``, the (R, 2C + 1) rows every rank's
    :func:`rank_stats` packed (the all_gather's result, in rank order): Chan et al.'s
    combination, identical on every rank.

    Raises:
        ValueError: (eager) the global batch has one value per channel (stock's message,
            naming the group's size); compiled code asserts it on the device instead
            (:data:`ONE_VALUE_MESSAGE`, a RuntimeError).
    """
    c = (gathered.shape[1] - 1) // 2
    # (method calls, not indexing: each op of this per-layer bookkeeping costs
    # microseconds, and a step has two per layer)
    counts = gathered.select(1, 0)
    means, vars_ = gathered.narrow(1, 1, c), gathered.narrow(1, c + 1, c)
    total: Tensor | int
    if compiling:
        total = counts.sum()
        # a device-side assertion: reading the count would break the graph
        torch._assert_async(total != 1, ONE_VALUE_MESSAGE)
        n: Tensor | int = total.clamp(min=1)
        bessel: Tensor | float = n / (total - 1).clamp(min=1)
    else:
        # read (a device sync on CUDA, as stock); tolist: one call, no tensor op
        total = int(sum(counts.tolist()))
        if total == 1:
            raise ValueError(_one_value_message(size, group))
        n = max(total, 1)
        bessel = n / max(total - 1, 1)
    # Chan et al.'s combination, with w_i = n_i / n and v_i = M2_i / n_i:
    # mean = sum(w_i mean_i), var = M2 / n = sum(w_i (v_i + (mean_i - mean)^2))
    w = counts / n
    g_mean = torch.mv(means.t(), w)
    dev = torch.sub(means, g_mean)
    var = torch.mv(dev.mul_(dev).add_(vars_).t(), w)
    invstd = torch.rsqrt(var.add(eps))
    unbiased = var.mul(bessel)  # M2 / (n - 1)
    return GlobalStats(g_mean, var, invstd, unbiased, total, counts, n)


def rank_output(
    input: Tensor,
    local: RankStats,
    weight: Tensor | None,
    bias: Tensor | None,
    stats: GlobalStats,
    eps: float,
) -> Tensor:
    """This rank's output: ``input`` normalized with the global statistics, in its dtype."""
    if input.numel() and local.params_acc:
        # the normalization itself on the device's batch-norm kernel: stock's
        # evaluation call with the global statistics (one vectorized pass; memory
        # format and half input as stock's kernels handle them)
        return _normalize(input, weight, bias, stats.mean, stats.var, eps)
    x, acc = local.x, local.x.dtype
    scale = stats.invstd if weight is None else stats.invstd * weight.to(acc)
    out = (x - _channel_view(stats.mean, x)) * _channel_view(scale, x)
    if bias is not None:
        out = out + _channel_view(bias.to(acc), x)
    return out.to(input.dtype)


def rank_sums(
    grad_out: Tensor,
    input: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    slots: Slots | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, bool]:
    """The backward's share of this rank before the collective: ``(dy, x, sum_dy,
    sum_dy_xmu, xmu, kernels)``, with ``dy`` / ``x`` in the statistics' dtype, the two
    per-channel (C,) sums, ``x - mean`` when the portable ops computed it (else None),
    and whether the device's kernels computed the sums."""
    acc = mean.dtype
    x = input if input.dtype == acc else input.to(acc)
    dy = grad_out if grad_out.dtype == acc else grad_out.to(acc)
    local = slots.sums(dy, x, mean, invstd, weight) if slots is not None and input.numel() else None
    xmu = None
    if local is not None:
        sum_dy, sum_dy_xmu = local
    elif input.numel():
        xmu = x - _channel_view(mean, dy)
        dims = _reduce_dims(dy)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
    else:
        sum_dy = sum_dy_xmu = torch.zeros_like(mean)
    return dy, x, sum_dy, sum_dy_xmu, xmu, local is not None


def rank_input_grad(
    dy: Tensor,
    x: Tensor,
    xmu: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sums: Tensor,
    counts: Tensor,
    n: Tensor | int,
    slots: Slots | None,
) -> Tensor:
    """This rank's input gradient (in the statistics' dtype) from ``sums``, the (2C,)
    ``[sum(dy), sum(dy * (x - mean))]`` added over every rank: the device's kernel where
    it takes the tensors, else the portable ops."""
    grad_input = (
        slots.input_grad(dy, x, mean, invstd, weight, sums, counts, n)
        if slots is not None
        else None
    )
    if grad_input is not None:
        return grad_input
    c = mean.numel()
    if xmu is None:
        xmu = x - _channel_view(mean, dy)
    scale = invstd if weight is None else invstd * weight.to(mean.dtype)
    mean_dy, mean_dy_xmu = sums[:c] / n, sums[c:] / n
    return (
        dy - _channel_view(mean_dy, dy) - xmu * _channel_view(invstd * invstd * mean_dy_xmu, dy)
    ) * _channel_view(scale, dy)


class _SyncBatchNorm(torch.autograd.Function):
    """Global batch statistics and normalization: one all_gather forward, one
    collective backward (:func:`_sum_over_ranks`). Between them, each rank's steps:
    :func:`rank_stats`, :func:`global_stats`, :func:`rank_output`; :func:`rank_sums`,
    :func:`rank_input_grad`."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        group: Any,
        world: int,
        size: torch.Size,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | int]:
        compiling = torch.compiler.is_compiling()
        local = rank_stats(input, weight, bias, compiling)
        c = local.x.shape[1]
        gathered = _all_gather(local.packed, group, world, compiling).view(world, 2 * c + 1)
        stats = global_stats(gathered, eps, compiling, size, group)
        out = rank_output(input, local, weight, bias, stats, eps)
        ctx.save_for_backward(input, weight, stats.mean, stats.invstd, stats.counts)
        ctx.group, ctx.world, ctx.has_bias = group, world, bias is not None
        ctx.slots, ctx.compiling = local.slots, compiling
        ctx.n = None if compiling else stats.n  # compiled: from the saved counts
        ctx.mark_non_differentiable(stats.mean, stats.unbiased)
        ctx.set_materialize_grads(False)  # (no zero gradients for the statistics)
        if compiling:
            ctx.mark_non_differentiable(stats.total)
        return out, stats.mean, stats.unbiased, stats.total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Any, ...]:
        input, weight, mean, invstd, counts = ctx.saved_tensors
        slots, compiling = ctx.slots, ctx.compiling
        dy, x, sum_dy, sum_dy_xmu, xmu, kernels = rank_sums(
            grad_out, input, mean, invstd, weight, slots
        )
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = _sum_over_ranks(torch.cat([sum_dy, sum_dy_xmu]), ctx.group, ctx.world, compiling)
            n = ctx.n if ctx.n is not None else counts.sum().clamp(min=1)
            grad_input = rank_input_grad(
                dy, x, xmu, mean, invstd, weight, sums, counts, n, slots if kernels else None
            ).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else mean.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


#: What a compiled synchronized layer's runtime assertion says (a RuntimeError) where eager
#: raises stock's ValueError: a graph cannot read the global count without a break.
ONE_VALUE_MESSAGE = (
    "Expected more than 1 value per channel when training (in the global "
    "batch of the layer's process_group)"
)


def _one_value_message(size: torch.Size, group: Any) -> str:
    return (
        f"Expected more than 1 value per channel when training, got input size {size} "
        f"(1 value per channel in the global batch of the {dist.get_world_size(group)} "
        "ranks of the layer's process_group)"
    )
