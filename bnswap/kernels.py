"""``bnswap.kernels``: which kernel torch binds a batch-norm op to.

One concern: torch's rule, in one place, for the plan's layer rows
(:func:`bnswap.plan.select_kernel`) and node rows (:class:`bnswap.programs.NodeRow`),
stock's ops and the consolidated ones, as torch's code has it in every supported release
(2.4.1, 2.9.1, 2.13.0, 2.14.1, 2.15.0).

**The selection** (:func:`rule`): ``at::native::_select_batch_norm_backend(input, weight,
bias, running_mean, running_var, training, eps)`` in
``aten/src/ATen/native/Normalization.cpp`` (``torch._C._select_batch_norm_backend`` in
Python; pytorch PR 116092) answers ``Cudnn`` when the input is on a CUDA device, neither
input nor weight is bfloat16, half input comes with a float32 weight, weight and bias are
both defined, both running statistics are defined (or neither, in training), the input
has 3 or more dimensions, its batch size is at most 880,801 in training (65,535 in eval),
torch was built with cuDNN (5.1.10 or newer), ``eps >= CUDNN_BN_MIN_EPSILON`` (0.0 in
the cuDNN 9 every supported release's CUDA wheels ship), ``torch.backends.cudnn.enabled``
(``userEnabledCuDNN()``, read when the op runs) and the
input has fewer than 2^31 - 1 elements; else, in a ROCm build, ``Miopen`` under the
conditions of :func:`rule`; else ``Native``.

**The ops** (``native_functions.yaml``; :data:`RUN_TIME_OPS`, :data:`NATIVE_OPS`,
:data:`CPU_ONLY_OPS`):

* ``aten.batch_norm`` (CompositeImplicitAutograd) calls ``_batch_norm_impl_index``, which
  selects at run time with its own arguments. Its ``cudnn_enabled`` argument is ignored in
  every supported release: ``_batch_norm_impl_index`` never reads it (the source's "TODO:
  remove cudnn_enabled arg" since PR 116092; issue 45: the disassembly of
  ``libtorch_cpu.so`` of each release loads only the ``training`` stack argument). So the
  ``cudnn_enabled=False`` that ``torch.export`` records (it traces with cuDNN off,
  ``_ignore_backend_decomps`` in ``torch/export/_trace.py``) changes nothing: stock's
  exported ``aten.batch_norm`` runs cuDNN on CUDA where the rule holds. Checked on
  torch 2.14.1+cu130 under ``FakeTensorMode`` on ``cuda:0``: ``aten.batch_norm.default(...,
  cudnn_enabled=False)`` dispatches ``aten.cudnn_batch_norm.default``
  (``tests/test_kernel_rule.py``).
* ``_batch_norm_with_update`` / ``_batch_norm_with_update_functional``: their CUDA kernel
  (``_batch_norm_with_update_cuda``, ``aten/src/ATen/native/cuda/Normalization.cu``)
  selects with ``training=True``; torch's own decomposition
  (``_get_batch_norm_reserve_tensor``, ``torch/_decomp/decompositions.py``) asks the same.
* ``batch_norm_backward``: ``_new_batch_norm_backward_cuda`` selects again with the
  forward's input, weight and statistics, a defined dummy bias and ``training=True``, so
  it follows its forward (whose reserve it then reads).
* ``native_batch_norm``, ``_native_batch_norm_legit`` (and ``.no_stats``, the autogen'd
  ``_native_batch_norm_legit_functional``), ``_native_batch_norm_legit_no_training``
  (CompositeExplicitAutograd, calls ``_native_batch_norm_legit``) and
  ``native_batch_norm_backward`` bind the native kernel (``batch_norm_cuda``,
  ``batch_norm_backward_cuda``): no selection.
* ``_batch_norm_no_update`` has one kernel, CompositeExplicitAutograd, which calls
  ``batch_norm_cpu``: it runs on the CPU only (issue 44; PR 119496, which would have given
  it a CUDA kernel, never merged).

**Per release** (:func:`stock_export_op`): what ``torch.export.export`` records for a
stock layer. Everything else here is the same in every supported release.

The kernel names are torch's (``torch._C._BatchNormBackend``): ``"Native"`` is the
device's own ATen kernel (PyTorch's CUDA kernel on a GPU). On a CUDA device that is not
present, the answer is predicted from the rule and says so (``"Cudnn (predicted)"``):
predicted from torch's code, not yet observed on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = [
    "CPU_ONLY_OPS",
    "CUDNN",
    "CUDNN_BN_MIN_EPSILON",
    "CUDNN_MAX_BATCH_EVAL",
    "CUDNN_MAX_BATCH_TRAINING",
    "CUDNN_MAX_NUMEL",
    "MIOPEN",
    "MIOPEN_DIM_MAX",
    "NATIVE",
    "NATIVE_OPS",
    "PREDICTED",
    "RUN_TIME_OPS",
    "Call",
    "check_device",
    "layer_call",
    "layer_device",
    "layer_kernel",
    "op_kernel",
    "rule",
    "select",
    "stock_export_op",
]

NATIVE, CUDNN, MIOPEN = "Native", "Cudnn", "Miopen"
#: What a kernel name on an absent CUDA device ends with.
PREDICTED = " (predicted)"

#: cuDNN's smallest batch-norm eps. torch selects cuDNN only for ``eps >=
#: batchnormMinEpsilonCuDNN()``, the ``CUDNN_BN_MIN_EPSILON`` of the cuDNN torch was built
#: with. cuDNN 9 defines it as 0.0 (``cudnn_ops.h`` of the nvidia-cudnn wheels), and the
#: CUDA wheels of every supported release pin cuDNN 9 (torch 2.4.1: nvidia-cudnn-cu12
#: 9.1.0.70; 2.9.1: 9.10.2.21; 2.14.1: nvidia-cudnn-cu13 9.24.0.43; 2.15.0: 9.26.0.51;
#: their PyPI metadata): no eps of a real layer is refused. (cuDNN 7 defined it as
#: 1e-5.) Checked on torch 2.14.1+cu130 under FakeTensorMode: eps 1e-10 and 0.0 select
#: cuDNN, -1e-3 does not.
CUDNN_BN_MIN_EPSILON = 0.0
#: The largest batch size (``input.size(0)``) torch hands cuDNN in training / in eval.
CUDNN_MAX_BATCH_TRAINING = 880_801
CUDNN_MAX_BATCH_EVAL = 65_535
#: ``input.numel()`` must be below this (``std::numeric_limits<int32_t>::max()``: some
#: cuDNN kernels index with 32 bits).
CUDNN_MAX_NUMEL = 2**31 - 1
#: MIOpen takes inputs of 3 to this many dimensions (``MIOPEN_DIM_MAX``).
MIOPEN_DIM_MAX = 5

_aten = torch.ops.aten
#: Ops whose kernel selects at run time (:func:`rule`), by their own arguments.
RUN_TIME_OPS = frozenset(
    {
        _aten.batch_norm,
        _aten._batch_norm_impl_index,
        _aten._batch_norm_with_update,
        _aten._batch_norm_with_update_functional,
        _aten.batch_norm_backward,
    }
)
#: Of those, the ones that select as in training whatever the layer's mode (their CUDA
#: kernels pass ``training=True``).
_TRAINING_SELECTION = frozenset(
    {
        _aten._batch_norm_with_update,
        _aten._batch_norm_with_update_functional,
        _aten.batch_norm_backward,
    }
)
#: Ops bound to the native kernel on every device (no selection).
NATIVE_OPS = frozenset(
    {
        _aten.native_batch_norm,
        _aten._native_batch_norm_legit,
        _aten._native_batch_norm_legit_functional,
        _aten._native_batch_norm_legit_no_training,
        _aten.native_batch_norm_backward,
    }
)
#: Ops with a kernel on the CPU only.
CPU_ONLY_OPS = frozenset({_aten._batch_norm_no_update})


@dataclass(frozen=True)
class Call:
    """What torch's selection reads of one batch-norm call.

    Attributes:
        rank: the input's number of dimensions, ``(N, C, *)``.
        dtype: the input's dtype.
        weight, bias: their dtypes, None when not passed (undefined).
        running_mean, running_var: whether each is passed.
        training: the ``training`` argument the selection sees.
        eps: the ``eps`` argument.
        batch: the input's size N, None when not known (taken to be within cuDNN's
            limits).
        numel: the input's number of elements, None when not known (likewise).
        channels_last: the input's suggested memory format is channels-last (MIOpen
            refuses it; cuDNN takes it).

    Examples::

        >>> import torch
        >>> from bnswap.kernels import Call
        >>> x, w = torch.empty(8, 3, 4, 4, device="meta"), torch.empty(3, device="meta")
        >>> call = Call.of(x, w, w, w, w, training=True, eps=1e-5)
        >>> call.rank, call.weight, call.batch, call.numel
        (4, torch.float32, 8, 384)
    """

    rank: int
    dtype: torch.dtype
    weight: torch.dtype | None
    bias: torch.dtype | None
    running_mean: bool
    running_var: bool
    training: bool
    eps: float
    batch: int | None = None
    numel: int | None = None
    channels_last: bool = False

    @classmethod
    def of(
        cls,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        training: bool,
        eps: float,
    ) -> Call:
        """The call of these arguments: real, fake or meta tensors (``(N, C, *)`` input,
        (C,) others), or None for one not passed. A symbolic size (a dynamic batch)
        is not known."""
        batch = input.shape[0] if input.dim() > 0 else None
        numel = input.numel()
        fmt = _suggested_format(input)
        return cls(
            rank=input.dim(),
            dtype=input.dtype,
            weight=None if weight is None else weight.dtype,
            bias=None if bias is None else bias.dtype,
            running_mean=running_mean is not None,
            running_var=running_var is not None,
            training=bool(training),
            eps=float(eps),
            batch=batch if isinstance(batch, int) else None,
            numel=numel if isinstance(numel, int) else None,
            channels_last=fmt,
        )


def _suggested_format(t: torch.Tensor) -> bool:
    """Whether ``t`` is laid out channels-last (2d or 3d) and not contiguous: what
    ``suggest_memory_format()`` calls channels-last (a size torch cannot decide without
    a value, under dynamic shapes: not)."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if fmt is None:
        return False
    try:
        return bool(t.is_contiguous(memory_format=fmt) and not t.is_contiguous())
    except Exception:  # (a data-dependent size: GuardOnDataDependentSymNode)
        return False


def _statistics_qualify(call: Call) -> bool:
    return (call.running_mean and call.running_var) or (
        not call.running_mean and not call.running_var and call.training
    )


def rule(call: Call, *, rocm: bool | None = None, cudnn_enabled: bool | None = None) -> str:
    """torch's selection for ``call`` on a GPU (``input.is_cuda()``), by the rule of
    ``at::native::_select_batch_norm_backend`` (``aten/src/ATen/native/Normalization.cpp``,
    every supported release): ``"Cudnn"``, ``"Miopen"`` or ``"Native"``.

    cuDNN (a CUDA build with cuDNN, as torch's CUDA wheels are):

    * ``input`` and ``weight`` not bfloat16; float16 input only with a float32 weight;
    * ``weight`` and ``bias`` both defined;
    * both running statistics defined, or neither and ``training``;
    * ``input.dim() >= 3``;
    * batch size at most :data:`CUDNN_MAX_BATCH_TRAINING` in training,
      :data:`CUDNN_MAX_BATCH_EVAL` in eval;
    * ``eps >= CUDNN_BN_MIN_EPSILON`` (0.0: cuDNN 9's);
    * cuDNN enabled: ``torch.backends.cudnn.enabled`` now (the op reads it when it runs);
    * ``input.numel() < CUDNN_MAX_NUMEL``.

    MIOpen (a ROCm build, where cuDNN's branch never holds: ``compiledWithCuDNN()`` is
    false): ``input.dim()`` from 3 to :data:`MIOPEN_DIM_MAX`, input neither float64 nor
    bfloat16, weight not float16, weight / bias / statistics as above, enabled (the same
    flag) and the input not channels-last.

    Args:
        call: the call (:class:`Call`).
        rocm: a ROCm build; default: this torch's (``torch.version.hip``).
        cudnn_enabled: default: ``torch.backends.cudnn.enabled`` now.

    Returns:
        The kernel torch's code picks, without asking a device.

    Examples::

        >>> import torch
        >>> from bnswap.kernels import Call, rule
        >>> call = Call(4, torch.float32, torch.float32, torch.float32, True, True, True, 1e-5)
        >>> rule(call), rule(call, cudnn_enabled=False)
        ('Cudnn', 'Native')
        >>> from dataclasses import replace
        >>> rule(replace(call, weight=None)), rule(replace(call, rank=2))  # affine=False, (N, C)
        ('Native', 'Native')
        >>> rule(replace(call, dtype=torch.float16, weight=torch.float16))  # a .half() layer
        'Native'
        >>> rule(replace(call, dtype=torch.float16))  # half input, float32 weight (autocast)
        'Cudnn'
    """
    enabled = torch.backends.cudnn.enabled if cudnn_enabled is None else cudnn_enabled
    if rocm is None:
        rocm = torch.version.hip is not None
    defined = call.weight is not None and call.bias is not None and _statistics_qualify(call)
    if not rocm:
        limit = CUDNN_MAX_BATCH_TRAINING if call.training else CUDNN_MAX_BATCH_EVAL
        if (
            torch.bfloat16 not in (call.dtype, call.weight)
            and (call.dtype != torch.float16 or call.weight == torch.float32)
            and defined
            and call.rank >= 3
            and (call.batch is None or call.batch <= limit)
            and call.eps >= CUDNN_BN_MIN_EPSILON
            and enabled
            and (call.numel is None or call.numel < CUDNN_MAX_NUMEL)
        ):
            return CUDNN
        return NATIVE
    if (
        3 <= call.rank <= MIOPEN_DIM_MAX
        and call.dtype not in (torch.float64, torch.bfloat16)
        and call.weight != torch.float16
        and defined
        and enabled
        and not call.channels_last
    ):
        return MIOPEN
    return NATIVE


def select(call: Call, device: torch.device | str) -> str:
    """The kernel torch picks for ``call`` on ``device``.

    * ``cuda`` where no CUDA device is present: :func:`rule`, marked ``" (predicted)"``;
    * a device present: torch's own answer, ``torch._C._select_batch_norm_backend`` on
      small tensors of the call's dtypes and rank on that device, then the batch size and
      element count of :func:`rule` (the probe is small); a call that passes no weight,
      bias or statistics torch's rule refuses is ``"Native"`` without a probe (the Python
      binding takes no undefined tensor);
    * ``"n/a (meta)"`` on the meta device, ``"n/a (torch too old)"`` for a torch without
      the function, ``"n/a (<error>)"`` where the probe cannot run (a device this torch
      was not built for).

    Examples::

        >>> import torch
        >>> from bnswap.kernels import Call, select
        >>> call = Call(4, torch.float32, torch.float32, torch.float32, True, True, True, 1e-5)
        >>> select(call, "cpu")
        'Native'
        >>> select(call, "cuda") if not torch.cuda.is_available() else "Cudnn (predicted)"
        'Cudnn (predicted)'
    """
    dev = torch.device(device)
    if dev.type == "meta":
        return "n/a (meta)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return rule(call) + PREDICTED
    selector = getattr(torch._C, "_select_batch_norm_backend", None)
    if selector is None:
        return "n/a (torch too old)"
    if call.weight is None or call.bias is None or not _statistics_qualify(call):
        return NATIVE  # (torch's rule refuses it on every device)
    try:
        x = torch.empty((2, 1) + (1,) * (call.rank - 2), dtype=call.dtype, device=dev)
        w = torch.ones(1, dtype=call.weight, device=dev)
        b = torch.zeros(1, dtype=call.bias, device=dev)
        stats = torch.ones(1, device=dev)
        if call.running_mean:
            answer = selector(x, w, b, stats, stats, call.training, call.eps).name
        else:  # neither, in training: the binding takes no undefined tensor; the
            # statistics are no condition once both or neither are given
            answer = selector(x, w, b, stats, stats, True, call.eps).name
    except Exception as e:  # a device this torch cannot probe: RuntimeError,
        # TypeError, AssertionError ("not compiled with XPU"), ModuleNotFoundError (torch.hpu)
        return f"n/a ({type(e).__name__})"
    # what the small probe cannot show: the batch size and element count (cuDNN), the
    # memory format (MIOpen)
    if answer == CUDNN and rule(call, rocm=False, cudnn_enabled=True) != CUDNN:
        return NATIVE
    if answer == MIOPEN and call.channels_last:
        return NATIVE
    return str(answer)


def op_kernel(op: object, call: Call | None, device: torch.device | str) -> str:
    """The kernel the batch-norm op ``op`` (an ``OpOverload``, e.g. a graph node's target,
    or its packet) runs on ``device`` for ``call``: :func:`select` for the ops that select
    at run time (:data:`RUN_TIME_OPS`; the consolidated ops and ``batch_norm_backward``
    with ``training=True``, the backward with a defined bias, as their CUDA kernels
    pass), ``"Native"`` for the ops bound to it (:data:`NATIVE_OPS`), and for
    ``_batch_norm_no_update`` off the CPU ``"CPU only (no CUDA kernel)"`` (the device's
    name). ``"n/a (meta)"`` on the meta device.

    Raises:
        ValueError: ``op`` is no batch-norm op this module knows, or a selecting op
            without ``call``.

    Examples::

        >>> import torch
        >>> from bnswap.kernels import Call, op_kernel
        >>> aten = torch.ops.aten
        >>> call = Call(4, torch.float32, torch.float32, torch.float32, True, True, True, 1e-5)
        >>> op_kernel(aten._native_batch_norm_legit_functional.default, call, "cuda")
        'Native'
        >>> op_kernel(aten._batch_norm_no_update.default, call, "cuda")
        'CPU only (no CUDA kernel)'
    """
    dev = torch.device(device)
    packet = getattr(op, "overloadpacket", op)
    if packet not in RUN_TIME_OPS and packet not in NATIVE_OPS and packet not in CPU_ONLY_OPS:
        raise ValueError(f"bnswap.kernels: {op} is no batch-norm op")
    if dev.type == "meta":
        return "n/a (meta)"
    if packet in CPU_ONLY_OPS:
        return NATIVE if dev.type == "cpu" else f"CPU only (no {dev.type.upper()} kernel)"
    if packet in NATIVE_OPS:
        return NATIVE
    if call is None:
        raise ValueError(f"bnswap.kernels: {op} selects by its arguments: a Call is needed")
    if packet in _TRAINING_SELECTION:
        call = replace(call, training=True)
    if packet is _aten.batch_norm_backward:
        call = replace(call, bias=torch.float32)  # (its kernel's dummy bias: at::empty(1))
    return select(call, dev)


def stock_export_op(version: str | None = None) -> str:
    """The op ``torch.export.export`` records for a stock layer in training on torch
    ``version`` (default: this one): ``"aten._native_batch_norm_legit_functional.default"``
    (the native kernel) on torch 2.4 (its export returns the functionalized ATen graph;
    ``make compat`` on 2.4.1, issue 45), ``"aten.batch_norm.default"`` with
    ``cudnn_enabled=False`` (selected at run time: cuDNN on CUDA) on 2.9.1, 2.13.0, 2.14.1
    and 2.15.0 (the training IR). Releases between 2.4 and 2.9 are not supported and are
    taken as 2.9.

    Examples::

        >>> from bnswap.kernels import stock_export_op
        >>> stock_export_op("2.4.1"), stock_export_op("2.13.0+cpu")
        ('aten._native_batch_norm_legit_functional.default', 'aten.batch_norm.default')
    """
    release = _release(version if version is not None else torch.__version__)
    if release < (2, 5):
        return "aten._native_batch_norm_legit_functional.default"
    return "aten.batch_norm.default"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------------- layers
#: the input dtypes a mixed-precision wrapper feeds (bnswap's core upcasts half
#: parameters next to float32 statistics: bnswap.functional.mixed_precision_params)
_REDUCED = (torch.float16, torch.bfloat16)


def _rank(m: nn.Module) -> int:
    if isinstance(m, (nn.BatchNorm3d, nn.LazyBatchNorm3d)):
        return 5
    if isinstance(m, (nn.BatchNorm2d, nn.LazyBatchNorm2d)):
        return 4
    return 3


def _takes_two_dims(m: nn.Module) -> bool:
    """A class fed (N, C) as often as (N, C, L)."""
    return isinstance(m, (nn.BatchNorm1d, nn.LazyBatchNorm1d))


def _dtype(t: object) -> torch.dtype | None:
    return t.dtype if isinstance(t, torch.Tensor) else None


def _input_dtype(m: nn.Module) -> torch.dtype:
    """The input's dtype, taken to be the layer's: its first floating (C,) tensor's
    (weight, bias, running_mean), else float32."""
    for name in ("weight", "bias", "running_mean"):
        t = getattr(m, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return torch.float32


def layer_call(
    m: nn.Module,
    *,
    training: bool,
    swapped: bool = True,
    rank: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[object, Call]:
    """The op a BatchNorm layer ``m`` calls in ``training`` (or eval) and what torch's
    selection sees of it: ``(op packet, Call)``.

    Stock's layer (``_BatchNorm.forward`` + ``F.batch_norm``): ``aten.batch_norm`` with
    its own weight / bias (None for affine=False), statistics when it tracks them
    (``track_running_stats=False`` passes none in training), ``training`` when it uses
    batch statistics (training, or no running statistics).

    A swapped layer (the design of issue 44): with batch statistics,
    ``_batch_norm_with_update`` with stand-in ones / zeros for a missing weight / bias
    (made like the layer's first (C,) tensor, else the input), and throw-away statistics
    when it has none; in eval with running statistics, stock's ``aten.batch_norm(...,
    training=False)`` with its own weight / bias (no stand-ins). Half weight and bias
    next to float32 statistics run upcast (``mixed_precision_params``).

    Args:
        m: the layer (a ``_BatchNorm``).
        training: the layer's mode.
        swapped: bnswap's layer (True) or stock's.
        rank: the input's rank; default 5 / 4 / 3 for BatchNorm3d / 2d / others.
        dtype: the input's dtype; default the layer's (its first floating (C,) tensor's,
            else float32).

    Examples::

        >>> from torch import nn
        >>> from bnswap.kernels import layer_call
        >>> op, call = layer_call(nn.BatchNorm2d(4, affine=False), training=True)
        >>> str(op), call.weight, call.training
        ('aten._batch_norm_with_update', torch.float32, True)
        >>> op, call = layer_call(nn.BatchNorm2d(4, affine=False), training=False)
        >>> str(op), call.weight, call.training
        ('aten.batch_norm', None, False)
    """
    x = dtype if dtype is not None else _input_dtype(m)
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    mean, var = getattr(m, "running_mean", None), getattr(m, "running_var", None)
    batch_stats = training or (mean is None and var is None)
    if training and not getattr(m, "track_running_stats", True):
        mean = var = None  # torch passes no buffers then
    w, b = _dtype(weight), _dtype(bias)
    if x in _REDUCED and _dtype(mean) == _dtype(var) == torch.float32:
        w = torch.float32 if w == x else w
        b = torch.float32 if b == x else b
    eps = float(getattr(m, "eps", 1e-5))
    r = rank if rank is not None else _rank(m)
    if not swapped or not batch_stats:
        call = Call(r, x, w, b, mean is not None, var is not None, batch_stats, eps)
        return _aten.batch_norm, call
    # the stand-ins (and throw-away statistics) are made like the first (C,) tensor the
    # core holds then, else like the input
    like = next((d for d in (w, b, _dtype(mean)) if d is not None), x)
    call = Call(r, x, w or like, b or like, True, True, True, eps)
    return _aten._batch_norm_with_update, call


def layer_device(m: nn.Module) -> torch.device:
    """The device of ``m``'s first parameter or buffer (its own, not its children's);
    the CPU for a layer with neither (affine=False, track_running_stats=False)."""
    for t in (*m._parameters.values(), *m._buffers.values()):
        if t is not None:
            return t.device
    return torch.device("cpu")


def _kernel_of(m: nn.Module, dev: torch.device, training: bool, swapped: bool, rank: int) -> str:
    op, call = layer_call(m, training=training, swapped=swapped, rank=rank)
    return op_kernel(op, call, dev)


def _join(by_rank: list[tuple[str, str]], sep: str = "; ") -> str:
    """``"Cudnn for (N, C, L); Native for (N, C)"``, or the one kernel when the ranks
    agree (the "(predicted)" mark once, after the first name)."""
    kernels = [k for _, k in by_rank]
    if all(k == kernels[0] for k in kernels):
        return kernels[0]
    return sep.join(
        f"{k if i == 0 else k.removesuffix(PREDICTED)} for {shape}"
        for i, (shape, k) in enumerate(by_rank)
    )


def layer_kernel(
    m: nn.Module,
    device: torch.device | str | None = None,
    *,
    swapped: bool = True,
    training: bool | None = None,
) -> str:
    """The kernel a BatchNorm layer runs on ``device`` (default: where its tensors are),
    by torch's rule for the call :func:`layer_call` makes.

    A ``BatchNorm1d`` names both input ranks where they differ, ``"Cudnn for (N, C, L);
    Native for (N, C)"`` (cuDNN needs ``input.dim() >= 3``). With ``training`` None, the
    training kernel, and ``"; eval <kernel>"`` when eval differs (a swapped affine=False
    layer: stand-ins in training, none in eval: ``"Cudnn (predicted); eval Native"``).

    Args:
        m: the layer.
        device: where; a CUDA device that is not present is predicted (:func:`select`).
        swapped: bnswap's layer (default) or stock's.
        training: one mode only (True / False), or None for both.

    Examples::

        >>> from torch import nn
        >>> from bnswap.kernels import layer_kernel
        >>> layer_kernel(nn.BatchNorm2d(4))
        'Native'
        >>> import torch
        >>> if not torch.cuda.is_available():
        ...     print(layer_kernel(nn.BatchNorm2d(4, affine=False), "cuda"))
        ...     print(layer_kernel(nn.BatchNorm2d(4, affine=False), "cuda", swapped=False))
        ...     print(layer_kernel(nn.BatchNorm1d(4), "cuda"))
        Cudnn (predicted); eval Native
        Native (predicted)
        Cudnn (predicted) for (N, C, L); Native for (N, C)
    """
    dev = torch.device(device) if device is not None else layer_device(m)
    ranks = [("(N, C, L)", 3), ("(N, C)", 2)] if _takes_two_dims(m) else [("", _rank(m))]
    modes: Iterable[bool] = (True, False) if training is None else (training,)
    found = []
    for mode in modes:
        by_rank = [(shape, _kernel_of(m, dev, mode, swapped, r)) for shape, r in ranks]
        bad = next((k for _, k in by_rank if k.startswith("n/a")), None)
        if bad is not None:
            return bad
        found.append(by_rank)
    text = _join(found[0])
    if len(found) == 2 and found[1] != found[0]:  # eval's, marked once already
        plain = [(shape, k.removesuffix(PREDICTED)) for shape, k in found[1]]
        text += "; eval " + _join(plain, ", ")
    return text


#: Device names people try for a GPU, which torch does not read: the error says 'cuda'.
_GPU_NAMES = ("gpu", "nvidia", "amd", "rocm", "cudnn")


def check_device(device: object, fn: str = "plan") -> torch.device | None:
    """``torch.device(device)`` (None stays None), with bnswap's error for what torch does
    not read: ``bnswap.plan``'s ``device`` (issue 46: ``device="gpu"`` gave torch's raw
    error listing 20 types).

    Raises:
        RuntimeError: (torch's type) a device type torch does not know, naming torch's
            types and, for a GPU's name (``"gpu"``), ``'cuda'``; a device string torch
            cannot read (``"cuda:x"``).
        TypeError: (torch's type) ``device`` is neither a ``torch.device``, a str, an int
            (torch's accelerator index) nor None.

    Examples::

        >>> from bnswap.kernels import check_device
        >>> check_device("cuda:1")
        device(type='cuda', index=1)
        >>> check_device("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: bnswap.plan: device 'gpu' is not a device type torch knows ...
    """
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"bnswap.{fn}: device is a torch.device, a str such as 'cuda' or 'cuda:1', an "
            f"accelerator index, or None, got {device!r}"
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        text = str(e)
        if text.startswith("Expected one of ") and " device type" in text:
            kinds = text.removeprefix("Expected one of ").partition(" device type")[0]
            kind = str(device).partition(":")[0]
            gpu = " (a GPU, NVIDIA's or AMD's, is 'cuda')" if kind.lower() in _GPU_NAMES else ""
            raise RuntimeError(
                f"bnswap.{fn}: device {kind!r} is not a device type torch knows{gpu}; "
                f"torch's are {kinds}, with an optional index ('cuda:1')"
            ) from None
        raise RuntimeError(
            f"bnswap.{fn}: device {device!r} is not one torch reads ({text}); e.g. 'cpu', "
            "'cuda', 'cuda:1', 'mps', 'xpu'"
        ) from None
