"""What ORT can run, checked on the model's BatchNorm layers before anything is built
(and again when the model changes under a wrapper), and the per-layer trace buffers of
affine=False layers with the stand-ins provider that hands them to the core while ORT's
export traces the model. Imports no ONNX Runtime."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from bnswap._swap import add_internal_buffer, drop_internal_buffers, is_swapped
from bnswap.ort.errors import UnsupportedLayerError

__all__ = [
    "PROVIDERS",
    "TRACE_BIAS",
    "TRACE_WEIGHT",
    "bn_layers",
    "check_devices",
    "check_layers",
    "trace_constants",
    "trace_stand_ins",
]

#: Names of the per-layer buffers holding an affine=False layer's constant ones / zeros
#: (:func:`trace_constants`), which the core uses instead of freshly made ones / zeros
#: only while ORT's export traces the layer (:func:`trace_stand_ins`). A traced constant
#: is the same value for every layer of one width, and ONNX Runtime training merges
#: equal constants (its common-subexpression pass), after which its gradient builder
#: defines the merged tensor's gradient once per layer ("Duplicate definition of name
#: ..._grad"); a buffer is a per-layer graph input that is never merged. Internal
#: buffers of the core (:func:`bnswap._swap.add_internal_buffer`: non-persistent, never
#: in the state_dict, left out of TorchScript's view, removed by :func:`bnswap.revert`).
TRACE_WEIGHT = "_bnswap_trace_weight"
TRACE_BIAS = "_bnswap_trace_bias"


def bn_layers(module: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """``(name, layer)`` for every ``_BatchNorm`` of ``module``, in ``named_modules()`` order."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, _BatchNorm)]


def check_layers(module: nn.Module) -> None:
    """Raise unless every BatchNorm layer is swapped, initialized, float32, on CPU / CUDA.

    Raises:
        UnsupportedLayerError: (a TypeError) ``"bnswap.ort.wrap: BatchNorm layer 'name'
            (Class) is not a bnswap layer ..."`` (ORT would export it with a momentum
            frozen at trace time), ``"... is an uninitialized LazyBatchNorm1d ..."``,
            ``"... has weight of dtype torch.float64; ONNX Runtime's CPU
            BatchNormInternal kernel is float32 only ..."``, ``"... is a SyncBatchNorm
            ..."`` (swapped or not: ORT cannot synchronize), or ``"... is on the meta
            device; ... Materialize the model first ..."``.
    """
    for name, m in bn_layers(module):
        label = name or type(m).__name__
        if not is_swapped(m):
            raise UnsupportedLayerError(
                f"bnswap.ort.wrap: BatchNorm layer {label!r} ({type(m).__name__}) is not a "
                "bnswap layer (SyncBatchNorm, an excluded layer, a subclass without an "
                "adapter, a layer added after wrapping, or a model reverted while wrapped). "
                "ORT would export it with a momentum frozen at trace time and "
                "PyTorch's running statistics would be lost. Convert it, wrap only "
                "submodules without it (BNSwap(backend='ort') keeps such children eager "
                "itself), or use backend='aten'. See bnswap.plan(model, backend='ort')."
            )
        if isinstance(m, nn.SyncBatchNorm):
            raise UnsupportedLayerError(
                f"bnswap.ort.wrap: layer {label!r} is a SyncBatchNorm; the ONNX Runtime "
                "backend cannot synchronize batch statistics across processes (its "
                "BatchNormInternal kernel sees one process's batch). Use backend='aten' "
                "(synchronized on every device), or wrap a module without it."
            )
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            raise UnsupportedLayerError(
                f"bnswap.ort.wrap: layer {label!r} is an uninitialized {type(m).__name__}: "
                "ONNX Runtime exports the model as it is, and this layer has no parameters "
                "yet. Run one forward of the model before wrapping it (the Lightning "
                "callback wraps such a child once it has), or use backend='aten'."
            )
        for pname, t in (
            ("weight", m.weight),
            ("bias", m.bias),
            ("running_mean", m.running_mean),
            ("running_var", m.running_var),
        ):
            if t is not None and t.dtype != torch.float32:
                raise UnsupportedLayerError(
                    f"bnswap.ort.wrap: layer {label!r} has {pname} of dtype {t.dtype}; ONNX "
                    "Runtime's CPU BatchNormInternal kernel is float32 only. Use float32 "
                    "parameters, or backend='aten'."
                )
            if t is not None and t.device.type == "meta":
                raise UnsupportedLayerError(
                    f"bnswap.ort.wrap: layer {label!r} is on the meta device; ORTModule "
                    "runs on CPU or CUDA and bnswap.ort adds per-layer buffers that "
                    "to_empty would leave uninitialized. Materialize the model first "
                    "(model.to_empty(device=...), then load its weights), then call "
                    "bnswap.convert(model, backend='ort'); bnswap.convert(model) "
                    "(backend='aten') works on the meta device."
                )
            if t is not None and t.device.type != "cpu" and t.device.type != "cuda":
                raise UnsupportedLayerError(
                    f"bnswap.ort.wrap: layer {label!r} is on {t.device}; "
                    "ORTModule runs on CPU or CUDA."
                )


#: ONNX Runtime's execution provider for each device type ORTModule can run a model on.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def check_devices(module: nn.Module, providers: list[str]) -> None:
    """Raise unless the installed ONNX Runtime can run every BatchNorm layer's device:
    the CPU with ``CPUExecutionProvider``, CUDA with ``CUDAExecutionProvider`` (only in
    ONNX Runtime's GPU training build: the ``ort`` extra; ``onnxruntime-training-cpu``,
    the ``ort-cpu`` extra, has none). Other devices are refused by :func:`check_layers`.

    Args:
        module: the model; its layers passed :func:`check_layers`.
        providers: ``onnxruntime.get_available_providers()``.

    Raises:
        UnsupportedLayerError: ``"bnswap.ort.wrap: layer 'name' is on cuda:0; this ONNX
            Runtime (providers: CPUExecutionProvider) cannot run CUDA ..."``.

    Examples::

        >>> from torch import nn
        >>> from bnswap.ort._layers import check_devices
        >>> check_devices(nn.Sequential(nn.BatchNorm1d(2)), ["CPUExecutionProvider"])
    """
    for name, m in bn_layers(module):
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is None:
                continue
            dev = t.device.type
            if PROVIDERS.get(dev, "") not in providers:
                raise UnsupportedLayerError(
                    f"bnswap.ort.wrap: layer {name or type(m).__name__!r} is on {t.device}; "
                    f"this ONNX Runtime (providers: {', '.join(providers) or 'none'}) cannot "
                    f"run {dev.upper()}: it needs {PROVIDERS.get(dev, 'a provider for it')}. "
                    "For CUDA install ONNX Runtime's GPU training build (bnswap's 'ort' extra; "
                    "'ort-cpu' is the CPU build), move the model to the CPU, or use "
                    "backend='aten' (every device)."
                )


def trace_constants(module: nn.Module, add: bool) -> None:
    """Register (``add``) or remove each affine=False layer's per-layer ones / zeros
    buffers (:data:`TRACE_WEIGHT` / :data:`TRACE_BIAS`, internal buffers of the core).

    Traced as constants, the ones / zeros of two affine=False layers of the same width
    are one value; ORT 1.19.2's pre-gradient optimizations merge them, and its gradient
    builder then emits the merged tensor's gradient once per BatchNormalizationGrad
    ("Duplicate definition of name ..._grad"). Buffers are graph inputs, one per layer,
    which ORT never merges; ORTModule feeds them by name.
    """
    for _, m in bn_layers(module):
        if m.affine:
            continue
        if not add:
            drop_internal_buffers(m, (TRACE_WEIGHT, TRACE_BIAS))
            continue
        if TRACE_WEIGHT in m._buffers and TRACE_BIAS in m._buffers:
            continue
        like = next((t for t in (m.running_mean, m.running_var) if t is not None), None)
        device = like.device if like is not None else torch.device("cpu")
        c = int(m.num_features)
        add_internal_buffer(m, TRACE_WEIGHT, torch.ones(c, device=device))
        add_internal_buffer(m, TRACE_BIAS, torch.zeros(c, device=device))


def trace_stand_ins(bn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The stand-ins provider of ORT's export
    (:func:`bnswap.functional.consolidated_ops_while_tracing`): ``bn``'s
    :data:`TRACE_WEIGHT` / :data:`TRACE_BIAS` buffers, None for one it lacks (the core
    then makes a constant)."""
    buffers = bn._buffers
    return buffers.get(TRACE_WEIGHT), buffers.get(TRACE_BIAS)
