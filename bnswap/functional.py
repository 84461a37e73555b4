"""The one batch-norm core every bnswap adapter uses (torch calls this layer
``functional``).

:func:`module_batch_norm` reproduces ``torch.nn.modules.batchnorm._BatchNorm.forward`` +
``F.batch_norm`` exactly. With batch statistics (training, or a layer without running
statistics) it runs PyTorch's consolidated, backend-agnostic ops (pytorch PR 116092):
``aten::_batch_norm_with_update``, with ``aten::batch_norm_backward`` as its derivative.
With running statistics (evaluation) it makes stock's own call, ``torch.batch_norm(...,
training=False, ...)``, with the layer's own weight and bias: ``aten::batch_norm`` picks
cuDNN / MIOpen / native when it runs, on every device, and is what stock's graphs hold.
Not ``aten::_batch_norm_no_update``: its only kernel (``CompositeExplicitAutograd`` in
``native_functions.yaml``) calls ``batch_norm_cpu``, which refuses every tensor that is
not on the CPU, so it cannot run on a GPU (``docs/design.md``, "The evaluation op").
The input checks (:func:`check_batch_norm_input`) and torch's
``exponential_average_factor`` rule (:func:`exponential_average_factor`) live here too.
What these ops need, and how the core provides it: ``docs/architecture.md``, "The core".
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "StandIns",
    "check_batch_norm_input",
    "check_momentum",
    "consolidated_ops_while_tracing",
    "exponential_average_factor",
    "mixed_precision_params",
    "module_batch_norm",
    "records_consolidated_ops",
]

#: A stand-ins provider: ``stand_ins(bn) -> (weight, bias)``, each a (C,) tensor or None,
#: for a layer ``bn`` without a weight / bias (affine=False) (see
#: :func:`consolidated_ops_while_tracing`).
StandIns = Callable[["_BatchNorm"], "tuple[Tensor | None, Tensor | None]"]

# torch.compiler.is_exporting: torch >= 2.5; older releases never run the assertion.
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_is_fake = torch._subclasses.fake_tensor.is_fake


def _faked(t: Tensor) -> bool:
    """Whether ``t`` is a fake tensor, or one traced under a fake mode (AOT's functional
    wrappers): it has no value to read."""
    return torch._C._get_dispatch_mode(_FAKE_MODE) is not None or _is_fake(t)


_tracing = threading.local()


@contextlib.contextmanager
def consolidated_ops_while_tracing(stand_ins: StandIns | None = None) -> Iterator[None]:
    """Inside the block (this thread), the TorchScript tracer records bnswap layers on the
    consolidated ops, not on stock's ``aten::batch_norm``.

    Outside it, a traced bnswap layer records exactly what stock records (its class's own
    ``forward``): ``torch.jit.trace`` and the TorchScript ONNX exporter give stock's graph.
    A backend that exports through the TorchScript tracer with symbolics of its own for
    the consolidated ops (e.g. :mod:`bnswap.ort`) wraps its export in this block.

    Args:
        stand_ins: optional ``stand_ins(bn) -> (weight, bias)``. The consolidated ops
            (batch statistics: training, or no running statistics) get a weight and a
            bias; a layer without them (affine=False) gets (C,) ones / zeros made
            like its first (C,) tensor (``full_like``). While the tracer records a layer
            inside the block, a tensor ``stand_ins(bn)`` returns is used instead (e.g. a
            per-layer buffer, which the tracer records as a graph input of that layer);
            None keeps the core's own. Called only then: never in eager, compiled or
            exported code, never outside the block. None: the core's own.

    Blocks nest: the innermost block's ``stand_ins`` applies (None included), and the
    enclosing block's applies again when it ends. Per thread.

    Examples::

        >>> import torch, bnswap
        >>> from bnswap.functional import consolidated_ops_while_tracing
        >>> bn = torch.nn.BatchNorm1d(2, affine=False, track_running_stats=False)
        >>> twos = lambda layer: (torch.full((2,), 2.0), None)  # weight 2, fresh bias
        >>> x = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # batch mean 1, variance 1
        >>> with consolidated_ops_while_tracing(stand_ins=twos):  # (TracerWarnings aside)
        ...     traced = torch.jit.trace(lambda x: bnswap.module_batch_norm(bn, x),
        ...                              x, check_trace=False)
        ...     eager = bnswap.module_batch_norm(bn, x)  # not tracing
        >>> traced(x), eager  # doctest: +NORMALIZE_WHITESPACE
        (tensor([[-2.0000, -2.0000], [ 2.0000,  2.0000]]),
         tensor([[-1.0000, -1.0000], [ 1.0000,  1.0000]]))
    """
    depth = getattr(_tracing, "depth", 0)
    before = getattr(_tracing, "stand_ins", None)
    _tracing.depth = depth + 1
    _tracing.stand_ins = stand_ins
    try:
        yield
    finally:
        _tracing.depth = depth
        _tracing.stand_ins = before


def records_consolidated_ops() -> bool:
    """True inside :func:`consolidated_ops_while_tracing` on this thread."""
    return getattr(_tracing, "depth", 0) > 0


_aten = torch.ops.aten
# The OpOverloads, not the packets: ``torch.ops.aten._batch_norm_with_update(...)`` resolves
# between its ``out`` and ``default`` overloads on every call, ~7 us per call on a 2-core
# Xeon, which made a bnswap layer measurably slower than stock on small inputs
# (benchmarks P3). The graphs record the same ``.default`` overloads either way.
_with_update = _aten._batch_norm_with_update.default
# Eager calls skip the OpOverload's Python ``__call__`` (it only calls ``_op``: one frame
# per forward, benchmarks P3); traced code keeps the OpOverloads dynamo knows.
_with_update_eager = _with_update._op

#: The message of the runtime assertion an exported program raises when a bnswap layer
#: gets an empty batch (see :func:`module_batch_norm`).
EMPTY_BATCH_MESSAGE = (
    "bnswap: a batch norm of this exported program got an empty input (a batch of 0); "
    "the consolidated op it runs in training (aten._batch_norm_with_update) rejects "
    "empty input, and an exported graph has no eager early return. Skip empty "
    "batches, or call bnswap.to_stock_ops(exported.module()) for stock's aten.batch_norm."
)

#: The same assertion's message in programs earlier bnswap releases wrote (they named
#: ``_batch_norm_no_update`` too): :func:`bnswap.to_stock_ops` removes either.
EMPTY_BATCH_MESSAGES = (
    EMPTY_BATCH_MESSAGE,
    "bnswap: a batch norm of this exported program got an empty input (a batch of 0); "
    "the consolidated ops it runs (aten._batch_norm_with_update / _batch_norm_no_update) "
    "reject empty input, and an exported graph has no eager early return. Skip empty "
    "batches, or call bnswap.to_stock_ops(exported.module()) for stock's aten.batch_norm.",
)


def _stock_checks_eps() -> bool:
    """Whether this torch's ``F.batch_norm`` rejects a non-positive eps in training
    (newer releases raise ValueError; older ones run the kernel)."""
    try:
        with torch.no_grad():
            torch.nn.functional.batch_norm(torch.ones(2, 1), None, None, training=True, eps=0.0)
    except ValueError as err:
        return "eps" in str(err)
    return False


# Probed once, at import, so compiled code sees a constant.
_CHECK_EPS = _stock_checks_eps()


def _raise_stock_momentum_error(momentum: object) -> None:
    """Raise stock's error for a momentum that is no number (``"a"``): the TypeError of
    ``torch.batch_norm``'s argument parser (``"batch_norm(): argument 'momentum'
    (position 7) must be float, not str"``), where the consolidated ops' schema raises a
    RuntimeError. Stock raises it in eval too (``_BatchNorm.forward`` always passes the
    momentum). A value its parser accepts returns (the op then takes it as stock does)."""
    probe = torch.zeros(2, 1)
    torch.batch_norm(probe, None, None, None, None, True, momentum, 1.0, False)  # type: ignore[arg-type]  # on purpose: its parser's TypeError


def check_momentum(momentum: object) -> None:
    """Raise stock's ``TypeError`` (``"batch_norm(): argument 'momentum' (position 7) must
    be float, not str"``) for a layer ``momentum`` that is no number, before any kernel or
    collective runs; None, Python and numpy numbers, bools and 0-dim tensors pass.

    Examples::

        >>> from bnswap.functional import check_momentum
        >>> check_momentum(0.1), check_momentum(None)
        (None, None)
        >>> check_momentum("a")
        Traceback (most recent call last):
        ...
        TypeError: batch_norm(): argument 'momentum' (position 7) must be float, not str
    """
    if momentum is not None and not isinstance(momentum, (numbers.Real, Tensor)):
        _raise_stock_momentum_error(momentum)


def check_batch_norm_input(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    use_batch_stats: bool,
    eps: float,
    *,
    synchronized: bool = False,
) -> None:
    """Raise what stock ``F.batch_norm`` raises for ``input``, before any kernel runs.

    Args:
        input: ``(N, C, *)`` floating-point tensor.
        weight, bias, running_mean, running_var: (C,) tensors or None, as they will be
            passed to the kernel (running stats are None when not used).
        use_batch_stats: True when the batch statistics are used (``F.batch_norm``'s
            ``training`` argument).
        eps: the layer's eps.
        synchronized: the checks of one rank of a synchronized layer
            (:mod:`bnswap.sync`), made before its first collective: no value-per-channel
            check (that one is on the global batch), and the channel and dtype checks
            on empty input too (an empty rank joins the collectives).

    Raises:
        NotImplementedError: non-floating input: stock's own error for the dtype and
            device (``"batch_norm" not implemented for 'Long'``, 'UInt16', ...; the
            backend's for quantized input), raised by stock's call on copies of the
            statistics.
        RuntimeError: ``"running_mean should contain C elements not K"`` (and the same
            for running_var, weight, bias, in that order), or ``"running_mean must be
            defined in evaluation mode"`` (same for running_var), as in ATen's
            ``_batch_norm_impl_index``.
        ValueError: ``"running_mean and running_var must either both be None or neither
            be None"`` when batch statistics are used with only one of them.
        ValueError: ``"Expected more than 1 value per channel when training, got input
            size ..."`` when batch statistics would come from one value per channel
            (``F._verify_batch_size``); the raw op would write NaN into running_var.
        ValueError: ``"batch_norm eps must be positive during training, but got ..."``
            / ``"batch_norm eps must be non-negative, but got ..."``, where this torch's
            ``F.batch_norm`` checks eps (after the value-per-channel check, as stock).
    """
    # Order as in stock: F._verify_batch_size (Python) first, then aten::batch_norm's
    # early return for empty input, its channel checks, and finally the kernel's dtype
    # dispatch.
    if use_batch_stats and not synchronized:
        torch.nn.functional._verify_batch_size(input.size())  # type: ignore[attr-defined]  # torch/nn/functional.pyi omits _verify_batch_size
    if _CHECK_EPS:
        if use_batch_stats and eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
        if eps < 0.0:
            raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    if input.numel() == 0 and not synchronized:
        return  # stock returns early for empty input (see module_batch_norm)
    num_features = input.shape[1]
    for label, t in (
        ("running_mean", running_mean),
        ("running_var", running_var),
        ("weight", weight),
        ("bias", bias),
    ):
        if t is not None:
            if t.numel() != num_features:
                raise RuntimeError(
                    f"{label} should contain {num_features} elements not {t.numel()}"
                )
        elif not use_batch_stats and label.startswith("running"):
            raise RuntimeError(f"{label} must be defined in evaluation mode")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be None")
    if not input.is_floating_point():
        # Stock's own call raises stock's dispatch error for this dtype and device (e.g.
        # '"batch_norm" not implemented for 'Long'', or the QuantizedCPU backend's) before
        # any kernel runs; on copies of the statistics, in case a dtype ever runs.
        probe = (
            input
            if input.numel()
            else torch.zeros((2, num_features), dtype=input.dtype, device=input.device)
        )
        torch.batch_norm(
            probe,
            weight,
            bias,
            None if running_mean is None else running_mean.clone(),
            None if running_var is None else running_var.clone(),
            use_batch_stats,
            0.0,
            eps,
            torch.backends.cudnn.enabled,
        )


#: Reduced-precision inputs torch's batch-norm kernels take with float32 parameters and
#: statistics (their mixed-dtype path). A frozenset: a float32 input is a hash miss, where
#: a tuple compares it with both (dtype ``__eq__`` calls on every forward).
_REDUCED = frozenset((torch.float16, torch.bfloat16))


def mixed_precision_params(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """``weight`` / ``bias`` as float32 when a mixed-precision wrapper cast them to the
    half input's dtype but left the statistics float32; unchanged otherwise.

    FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (and FSDP1's
    ``MixedPrecision(param_dtype=...)``) casts Parameters and inputs, never buffers: a
    BatchNorm then gets bfloat16 input, bfloat16 weight and bias, float32 running
    statistics, a combination every batch-norm kernel refuses (``RuntimeError: expected
    scalar type BFloat16 but found Float``; pytorch/torchtitan#674,
    Lightning-AI/pytorch-lightning#18802). torch's mixed-dtype path takes half input
    with float32 weight, bias and statistics (ATen ``is_mixed_type`` /
    ``check_mixed_data_type``, ``aten/src/ATen/native/mixed_dtype.h``; cuDNN wants float32
    parameters for half input too): the normalization runs in float32 and returns the
    input's dtype. So the parameters run upcast: exactly stock ``nn.BatchNorm`` with
    float32 weight and bias equal to the cast ones, on the same input; their gradients
    are that run's, cast back to the parameters' dtype by autograd.

    Args:
        input: ``(N, C, *)`` tensor.
        weight, bias: (C,) tensors or None, as the layer holds them.
        running_mean, running_var: (C,) tensors, or None when not used.

    Returns:
        ``(weight, bias)``: upcast to float32 when ``input`` is float16 / bfloat16, both
        statistics are float32 and the parameter has the input's dtype; otherwise the
        arguments. Any other mismatch (float64 statistics, float16 weight with bfloat16
        input) keeps stock's error.

    Examples::

        >>> import torch
        >>> from bnswap.functional import mixed_precision_params
        >>> x, w = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)
        >>> stats = torch.zeros(3), torch.ones(3)
        >>> [t.dtype for t in mixed_precision_params(x, w, w, *stats)]
        [torch.float32, torch.float32]
        >>> mixed_precision_params(x, w, w, None, None)[0].dtype  # no statistics: all bf16
        torch.bfloat16
    """
    if (
        running_mean is None
        or running_var is None
        or running_mean.dtype != torch.float32
        or running_var.dtype != torch.float32
    ):
        return weight, bias
    dtype = input.dtype
    if weight is not None and weight.dtype == dtype:
        weight = weight.float()
    if bias is not None and bias.dtype == dtype:
        bias = bias.float()
    return weight, bias


def exponential_average_factor(
    momentum: float | None,
    num_batches_tracked: Tensor | None,
    *,
    traced: bool = False,
    like: Tensor | None = None,
) -> float | Tensor:
    """torch's ``exponential_average_factor`` (``_BatchNorm.forward``): the weight of the
    batch statistics in the running-statistics update of a training step, after that
    step's ``num_batches_tracked`` increment.

    Args:
        momentum: the layer's momentum; None for a cumulative moving average.
        num_batches_tracked: the layer's 0-dim int64 counter, already incremented; None
            when the step does not count batches (then the factor is momentum, or 0.0).
        traced: with momentum None, return ``1 / n`` as a tensor instead of reading the
            counter as a Python float. Code being compiled or exported keeps the factor in
            the graph (stock's ``float()`` breaks it: pytorch issue 194504).
        like: with ``traced``, the tensor ``1 / n`` is made like (the running
            statistics, (C,)): ``full_like(like, 1.0) / n``, in its dtype (float64
            statistics get the float64 factor stock's Python float gives) and on its
            device, shape (C,); the graph names no dtype or device, so it moves as the
            statistics do (issue 25). None: ``num_batches_tracked.reciprocal()``, a
            0-dim tensor in torch's default float dtype.

    Returns:
        ``momentum``; or ``1 / num_batches_tracked`` (float, or a tensor when ``traced``)
        for momentum None; 0.0 for momentum None without a counter.

    Used by the eager and compiled paths of :func:`module_batch_norm` and by backends
    that keep the running statistics themselves (e.g. :mod:`bnswap.ort`), so they cannot
    differ.

    Examples::

        >>> import torch
        >>> from bnswap.functional import exponential_average_factor
        >>> exponential_average_factor(0.1, torch.tensor(5))
        0.1
        >>> exponential_average_factor(None, torch.tensor(4))
        0.25
        >>> exponential_average_factor(None, None)  # track_running_stats=False
        0.0
        >>> exponential_average_factor(None, torch.tensor(4), traced=True)
        tensor(0.2500)
        >>> stats = torch.zeros(2, dtype=torch.float64)
        >>> exponential_average_factor(None, torch.tensor(3), traced=True, like=stats)
        tensor([0.3333, 0.3333], dtype=torch.float64)
    """
    if momentum is not None:
        return momentum
    if num_batches_tracked is None:
        return 0.0
    if traced:
        if like is None:
            return num_batches_tracked.reciprocal()
        return torch.full_like(like, 1.0).div_(num_batches_tracked)
    return 1.0 / float(num_batches_tracked)


def _tensors(bn: _BatchNorm) -> tuple[Tensor | None, ...]:
    """``bn``'s weight, bias, running_mean, running_var, num_batches_tracked.

    Read from its ``_parameters`` / ``_buffers`` dicts: ``nn.Module.__getattr__`` is a
    Python call per name (five per forward, ~1.5 us at small sizes: benchmarks P3), and
    the dicts are where it finds them. A parametrized layer (``torch.nn.utils.parametrize``
    puts its tensors behind properties) is read by attribute, as torch does."""
    if "parametrizations" in bn._modules:
        return bn.weight, bn.bias, bn.running_mean, bn.running_var, _counter(bn)
    p, b = bn._parameters, bn._buffers
    try:
        return (
            p["weight"],
            p["bias"],
            b["running_mean"],
            b["running_var"],
            b["num_batches_tracked"],
        )
    except KeyError:  # a layer that unregistered one (stock's attribute lookup decides)
        return bn.weight, bn.bias, bn.running_mean, bn.running_var, _counter(bn)


def _counter(bn: _BatchNorm) -> Tensor | None:
    """``bn.num_batches_tracked`` read as stock reads it: only where it counts a batch
    (training with ``track_running_stats``; a layer without the attribute raises stock's
    ``AttributeError`` there). Elsewhere the counter is not used, and a layer without it
    (a whole-model pickle from torch 0.3, before the buffer existed, issue 46) runs as
    stock's: None."""
    if bn.training and bn.track_running_stats:
        return bn.num_batches_tracked
    return getattr(bn, "num_batches_tracked", None)


def module_batch_norm(bn: _BatchNorm, input: Tensor) -> Tensor:
    """Normalize ``input`` the way ``bn`` (a ``_BatchNorm``) would: with batch statistics on
    the consolidated ops, with running statistics on stock's ``aten::batch_norm``.

    Exactly ``_BatchNorm.forward`` semantics: batch statistics in training or when the
    layer has no running statistics, running statistics otherwise; running_mean /
    running_var updated (unbiased batch variance, momentum or cumulative average) and
    num_batches_tracked incremented only in training with ``track_running_stats=True``.

    Args:
        bn: the layer (its ``training``, ``track_running_stats``, ``momentum``, ``eps``,
            ``weight``, ``bias``, ``running_mean``, ``running_var``,
            ``num_batches_tracked`` are read; the buffers are updated in place).
        input: ``(N, C, *)`` tensor, float16 / bfloat16 / float32 / float64, any memory
            format (channels_last is preserved). Rank checks are the caller's
            (``bn._check_input_dim``).

    Returns:
        Tensor of the same shape, dtype and memory format as ``input``.

    Raises:
        What :func:`check_batch_norm_input` raises, before any state changes; the
        kernel's own errors (``"mixed dtype (CPU): ..."``) after the batch is counted,
        as stock.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> bn, stock = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        >>> x = torch.randn(4, 3, 5, 5)
        >>> torch.equal(bnswap.module_batch_norm(bn, x), stock(x))  # stock's forward
        True
        >>> torch.equal(bn.running_var, stock.running_var), int(bn.num_batches_tracked)
        (True, 1)
    """
    # The modes of _BatchNorm.forward, as named steps: which statistics normalize, which
    # are updated, then the checks, the batch count, and one kernel call per mode.
    training = bn.training
    weight, bias, running_mean, running_var, nbt = _tensors(bn)
    # batch statistics in training, or when the layer has no running statistics
    use_batch_stats = training or (running_mean is None and running_var is None)
    if training and not bn.track_running_stats:  # torch passes no buffers then
        running_mean = running_var = None
    # the running statistics move exactly when batch statistics are used and passed
    update = use_batch_stats and running_mean is not None

    check_batch_norm_input(input, weight, bias, running_mean, running_var, use_batch_stats, bn.eps)
    if input.dtype in _REDUCED:  # half parameters with float32 statistics (FSDP2)
        weight, bias = mixed_precision_params(input, weight, bias, running_mean, running_var)
    momentum = bn.momentum
    # (a float first: the ABC check of numbers.Real costs ~0.2 us on every forward)
    if momentum is not None and type(momentum) is not float:
        check_momentum(momentum)
    compiling = torch.compiler.is_compiling()  # dynamo / export tracing: constant per graph
    if momentum is None and not compiling and nbt is not None and _faked(nbt):
        # torch 2.4's export and AOT trace torch.nn's modules with fake tensors outside
        # dynamo (is_compiling() is False there): traced too, the counter has no value
        compiling = True
    if (
        use_batch_stats
        and compiling
        and _is_exporting()
        and isinstance(input.numel(), torch.SymInt)
    ):
        _assert_batch_not_empty(input)

    counts = training and bn.track_running_stats and nbt is not None  # as _BatchNorm.forward
    if counts:
        assert nbt is not None  # counts says so
        nbt.add_(1)
    # Compiled code keeps the cumulative factor in the graph (a tensor): reading the
    # counter as a float breaks it (pytorch issue 194504). (A momentum is its own factor:
    # no call on every forward for it.)
    factor = (
        momentum
        if momentum is not None
        else exponential_average_factor(
            momentum, nbt if counts else None, traced=compiling, like=running_mean
        )
    )

    if not use_batch_stats or (not compiling and torch._C._are_functorch_transforms_active()):
        # Evaluation: stock's own call, on every device (aten._batch_norm_no_update has
        # no kernel off the CPU: docs/design.md, "The evaluation op"), so its graphs are
        # stock's. Inside torch.func transforms (vmap, grad, jacrev, ...) every mode takes
        # it: functorch has batching rules for aten::batch_norm but none for the
        # consolidated ops. The op stock's F.batch_norm ends in, with its arguments (same
        # results, same errors: F.batch_norm's checks ran above); not F.batch_norm
        # itself: a user's patch of it reaches stock layers only, in every mode
        # (docs/kernels.md, "torch.compile").
        assert not isinstance(factor, Tensor)  # a tensor factor only while counting, compiled
        return torch.batch_norm(
            input,
            weight,
            bias,
            running_mean,
            running_var,
            use_batch_stats,
            factor,
            bn.eps,
            torch.backends.cudnn.enabled,
        )
    if input.numel() == 0:
        return _empty_batch(input, weight, bias)
    if weight is None or bias is None or not update:
        # what bnswap's stand-ins are made like: a (C,) tensor of the layer, else a view
        # of the input (nothing of their own a captured graph would carry)
        first = next((t for t in (weight, bias, running_mean) if t is not None), None)
        like = _channel_view(input) if first is None else first
        weight, bias = _stand_ins(bn, like, weight, bias)

    if not update:
        return _normalize_with_batch_stats(input, weight, bias, like, factor, bn.eps)
    assert running_mean is not None and running_var is not None  # update says so (and the check)
    if counts and momentum is None and compiling:
        assert isinstance(factor, Tensor)  # exponential_average_factor(traced=True)
        return _update_cumulative_traced(
            input, weight, bias, running_mean, running_var, factor, bn.eps
        )
    return _normalize_and_update(
        input, weight, bias, running_mean, running_var, factor, bn.eps, compiling
    )


def _assert_batch_not_empty(input: Tensor) -> None:
    """torch.export assumes a dynamic size is never 0 (its 0/1 specialization), so the
    empty-input branch of :func:`module_batch_norm` is traced away, and the consolidated
    ops reject an empty input at run time with a kernel error. Stock's exported
    aten.batch_norm returns early instead. A runtime assertion in the graph (checked
    before the num_batches_tracked update, so no state changes) says so clearly;
    bnswap.to_stock_ops removes it again with the op it guards."""
    torch.ops.aten._assert_scalar.default(input.numel() != 0, EMPTY_BATCH_MESSAGE)


def _empty_batch(input: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """aten::batch_norm's early return for empty input: no kernel, no statistics."""
    out = input.clone()
    # select(), as ATen does: the same IndexError message when C == 0.
    if weight is not None:
        out = out * weight.select(0, 0)
    if bias is not None:
        out = out + bias.select(0, 0)
    return out


#: The index of :func:`_channel_view` by input rank: ``x[0, :, 0, ...]``.
_CHANNEL_INDEX = {rank: (0, slice(None)) + (0,) * (rank - 2) for rank in range(2, 9)}


def _channel_view(input: Tensor) -> Tensor:
    """A (C,) view of ``input`` ``(N, C, *)``: the first element of each channel. No kernel
    runs and nothing is copied; it is what a layer without any (C,) tensor of its own
    makes its stand-ins like (:func:`_stand_ins`). One indexing call (a graph records
    ``aten.select`` nodes): a loop of ``select`` calls cost several times as much on
    every forward."""
    rank = input.dim()
    return input[_CHANNEL_INDEX.get(rank) or (0, slice(None)) + (0,) * (rank - 2)]


def _stand_ins(
    bn: _BatchNorm, like: Tensor, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The weight and bias the ops need: the layer's own, or ``full_like(like, 1.0)`` /
    ``full_like(like, 0.0)``; while the TorchScript tracer records the layer, the
    stand-ins of the enclosing :func:`consolidated_ops_while_tracing` block, if it has a
    provider.

    ``like`` is the layer's first (C,) tensor (weight, bias, running_mean) or, for a layer
    with none (affine=False, track_running_stats=False), :func:`_channel_view` of the
    input: the stand-ins take its dtype and device when they are computed. A captured
    graph records ``aten.full_like(like, value)`` and no device or dtype of its own, so
    it moves (``.to("cuda")``, ``.double()``, ``move_to_device_pass``) as stock's
    program, which passes None, moves (issue 25; ``docs/design.md``, "Programs that
    move"). The same dtype rule as stock's kernel: float32 running statistics with half
    input select the mixed-dtype path stock's layer runs; a layer with no tensor of its
    own runs in the input's dtype, as stock's kernel with no parameters does."""
    if (weight is None or bias is None) and torch.jit.is_tracing():
        provider = getattr(_tracing, "stand_ins", None)  # consolidated_ops_while_tracing
        if provider is not None:
            traced_weight, traced_bias = provider(bn)
            weight = traced_weight if weight is None else weight
            bias = traced_bias if bias is None else bias
    if weight is None:
        weight = torch.full_like(like, 1.0)
    if bias is None:
        bias = torch.full_like(like, 0.0)
    return weight, bias


def _normalize_with_batch_stats(
    input: Tensor, weight: Tensor, bias: Tensor, like: Tensor, factor: float | Tensor, eps: float
) -> Tensor:
    """Batch statistics only (``track_running_stats=False``): the op needs statistics to
    write to; these throw-away ones, made like the stand-ins (:func:`_stand_ins`), are
    dropped. ``factor`` is stock's F.batch_norm momentum (it only moves the scratch
    statistics): bnswap.to_stock_ops maps the node back to stock's call argument for
    argument."""
    scratch_mean = torch.full_like(like, 0.0)
    scratch_var = torch.full_like(like, 1.0)
    out: Tensor = _with_update(input, weight, bias, scratch_mean, scratch_var, factor, eps)[0]
    return out


def _update_cumulative_traced(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    factor: Tensor,
    eps: float,
) -> Tensor:
    """``momentum=None`` in a graph: batch statistics via momentum 1 on scratch
    statistics, then ``running += (batch - running) / num_batches_tracked`` (``factor``,
    a (C,) tensor made like running_mean: :func:`exponential_average_factor`), with no
    graph break.

    No ``torch.no_grad()`` (nothing here requires grad), and none wanted: under
    torch.export it became a wrap_with_set_grad_enabled node whose missing meta made
    torch.export.load refuse the saved program."""
    batch_mean = torch.zeros_like(running_mean)
    batch_var = torch.zeros_like(running_var)
    out: Tensor = _with_update(input, weight, bias, batch_mean, batch_var, 1.0, eps)[0]
    running_mean.lerp_(batch_mean, factor)
    running_var.lerp_(batch_var, factor)
    return out


def _normalize_and_update(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    factor: float | Tensor,
    eps: float,
    compiling: bool,
) -> Tensor:
    """Training with running statistics: batch statistics normalize, and the op moves
    running_mean / running_var by ``factor`` (the unbiased batch variance into
    running_var)."""
    out: Tensor = (_with_update if compiling else _with_update_eager)(
        input, weight, bias, running_mean, running_var, factor, eps
    )[0]
    return out
