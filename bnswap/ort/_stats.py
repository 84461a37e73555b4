"""PyTorch's running-statistics rule around an ORT training step.

Under raw ORTModule the running statistics of a BatchNorm layer differ from eager
PyTorch in four ways: the exporter's tracing forward applies one extra update, ORT never
increments ``num_batches_tracked``, ORT blends in the *biased* batch variance, and
``momentum=None`` is frozen at its trace-time value. bnswap exports every training-mode
batch norm with ONNX ``momentum=0`` (:mod:`bnswap.ort._symbolic`), so after an ORT
forward each ``running_mean`` / ``running_var`` buffer holds that step's batch mean /
biased batch variance (``BatchNormInternal`` aliases its running-stat outputs to the
input buffers). :class:`RunningStats` saves the old values before the call and then
applies ``torch.nn.modules.batchnorm._BatchNorm``'s rule exactly::

    num_batches_tracked += 1
    m = momentum if momentum is not None else 1 / num_batches_tracked
    running_mean = (1 - m) * old_mean + m * batch_mean
    running_var  = (1 - m) * old_var  + m * batch_var_biased * n / (n - 1)

with ``n = N * prod(spatial)`` the number of values per channel the layer saw. ``n`` is
read from the layer's input shape, found by a shape-only pass of the model on the meta
device (cached per input-shape signature; a real no-grad pass with buffers restored if
the model cannot run on meta).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from bnswap.functional import exponential_average_factor
from bnswap.ort.errors import LayerRunsTwiceError, StatsNotWrittenError

logger = logging.getLogger("bnswap.ort")

T = TypeVar("T")

# Written into running_mean before a verifying step; ORT's momentum-0 update replaces it
# with the batch mean (sentinel * 0 + mean), so a survivor means no write happened.
_SENTINEL = 1.0e30

__all__ = ["RunningStats", "leaf_key", "tracked_layers"]


def tracked_layers(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers among ``layers`` ((name, module) pairs, e.g.
    ``root.named_modules()``) that have running statistics (tracked)."""
    return [
        (name, m)
        for name, m in layers
        if isinstance(m, _BatchNorm)
        and m.track_running_stats
        and m.running_mean is not None
        and m.running_var is not None
    ]


def leaf_key(x: Any) -> Any:
    """A hashable stand-in for a non-tensor forward argument: its value when it is a
    plain scalar / string / None, else its identity."""
    return (type(x).__name__, x if isinstance(x, (int, float, bool, str, type(None))) else id(x))


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (
        str(spec),
        tuple(
            (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else leaf_key(x)
            for x in leaves
        ),
    )


class RunningStats:
    """Applies eager PyTorch's running-statistics update to ``root``'s BatchNorm layers
    around a call that ran them through ORT's ``BatchNormInternal`` with ONNX momentum 0.

    Args:
        root: the module ORT runs (the original, unflattened module).
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # input signature -> {BatchNorm layer's qualified name: its input shape per call}
        self._shapes: dict[tuple[Any, ...], dict[str, list[tuple[int, ...]]]] = {}
        #: Whether the last :meth:`step` verified ORT's write for every layer that ran.
        self.verified = False

    # ------------------------------------------------------------------ shapes
    def _shapes_of(self, forward: Callable[[], Any]) -> dict[str, list[tuple[int, ...]]]:
        """Run ``forward()`` (a pass of ``root``) under no_grad, recording the input
        shape of every call of every BatchNorm layer, by qualified name."""
        seen: dict[str, list[tuple[int, ...]]] = {}

        def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
            def pre(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
                seen.setdefault(name, []).append(tuple(inputs[0].shape))

            return pre

        handles = [
            m.register_forward_pre_hook(hook(name))
            for name, m in self.root.named_modules()
            if isinstance(m, _BatchNorm)
        ]
        try:
            with torch.no_grad():
                forward()
        finally:
            for h in handles:
                h.remove()
        return seen

    def _meta_pass(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``root`` on meta copies of its tensors and of the inputs: shapes only, no
        compute, no state touched."""
        state: dict[str, torch.Tensor] = {}
        for name, p in self.root.named_parameters():
            state[name] = p.detach().to("meta")
        for name, b in self.root.named_buffers():
            # num_batches_tracked stays real: momentum=None reads it as a float.
            state[name] = b.clone() if b.dtype == torch.long and b.dim() == 0 else b.to("meta")
        margs, mkwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (args, kwargs)
        )
        functional_call(self.root, state, margs, mkwargs)

    def _real_pass(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``root`` on the inputs, every buffer restored afterwards."""
        saved = [(b, b.clone()) for b in self.root.buffers()]
        try:
            self.root(*args, **kwargs)
        finally:
            for b, old in saved:
                b.copy_(old)

    def input_shapes(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, list[tuple[int, ...]]]:
        """The input shape of every call of every BatchNorm layer of ``root`` (keyed by
        its qualified name) for these inputs, from a shape-only pass on the meta device (a
        real no-grad pass, buffers restored, when the model cannot run on meta). Cached
        per input signature (shapes, dtypes, devices, structure, non-tensor values).

        Raises:
            What the model raises for these inputs in eager mode (wrong rank, channel
            count, one value per channel...), before ORT runs.
        """
        key = _signature(args, kwargs)
        shapes = self._shapes.get(key)
        if shapes is None:
            try:
                shapes = self._shapes_of(lambda: self._meta_pass(args, kwargs))
            except Exception as err:  # any meta failure: use a real pass
                logger.debug("bnswap.ort: meta shape pass failed (%s); using a real pass", err)
                shapes = self._shapes_of(lambda: self._real_pass(args, kwargs))
            if len(self._shapes) > 64:
                self._shapes.clear()
            self._shapes[key] = shapes
        return shapes

    def reduction_sizes(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], layers: list[tuple[str, _BatchNorm]]
    ) -> list[int | None]:
        """Values per channel (``N * prod(spatial)``) each of ``layers`` sees for these
        inputs; None for a layer the forward does not run. ``layers``: (qualified name in
        ``root``, layer) pairs.

        Raises:
            What :meth:`input_shapes` raises.
            LayerRunsTwiceError (an ORTRunError): a layer runs more than once per forward.
        """
        seen = self.input_shapes(args, kwargs)
        sizes: list[int | None] = []
        for name, _m in layers:
            shapes = seen.get(name)
            if shapes is None:
                sizes.append(None)  # not run by this forward: no update, as in eager
                continue
            if len(shapes) > 1:
                raise LayerRunsTwiceError(
                    f"bnswap.ort: BatchNorm layer {name!r} runs {len(shapes)} times in one "
                    "forward; ONNX Runtime updates its running statistics once per call site "
                    "into the same buffers, which cannot reproduce PyTorch's sequential "
                    "updates. Use one layer per call site, or backend='aten'."
                )
            shape = shapes[0]
            sizes.append(math.prod(shape[:1] + shape[2:]))
        return sizes

    def empty_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], layers: list[tuple[str, _BatchNorm]]
    ) -> tuple[bool, ...]:
        """Per layer of ``layers``: whether a call of it gets an empty input for these
        inputs. A graph traced then holds no batch norm for that layer (the core's
        early return for empty input), so it must not serve non-empty batches."""
        seen = self.input_shapes(args, kwargs)
        return tuple(any(0 in s for s in seen.get(name, ())) for name, _ in layers)

    def invalidate(self) -> None:
        """Forget the cached input shapes (the model's structure changed)."""
        self._shapes.clear()

    # -------------------------------------------------------------------- step
    def step(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[[], T],
        *,
        verify: bool,
        layers: list[tuple[str, nn.Module]],
        eager: Callable[[], T] | None = None,
    ) -> T:
        """Run ``run()`` (an ORT training forward of ``root`` on ``args``/``kwargs``) and
        leave every tracked layer's running_mean, running_var and num_batches_tracked
        exactly as an eager forward would. On error, the statistics are restored.

        Args:
            verify: first step of a new ORT session: fill running_mean with a sentinel
                before the call and check ORT overwrote it with the batch mean (ONNX
                momentum 0), i.e. that its aliased in-place write reached the buffer.
            layers: ``root``'s (qualified name, module) pairs, all of them or its
                BatchNorm layers (the caller has walked the model already).
            eager: run instead of ``run`` when every tracked layer that runs sees an
                empty batch (N = 0): there is nothing for ORT to compute, and ORT 1.19.2's
                backward rejects the empty gradient ("ORT only supports contiguous
                tensor"). The eager layers count the batch and keep their statistics,
                as stock does.

        Raises:
            StatsNotWrittenError (an ORTRunError): ``verify`` and ORT did not write a
                layer's statistics (the statistics are restored; nothing is silently
                wrong).
        """
        tracked = tracked_layers(layers)
        sizes = self.reduction_sizes(args, kwargs, tracked) if tracked else []
        ran = [(m, n) for (_, m), n in zip(tracked, sizes, strict=True) if n is not None]
        # verified: every layer that ran was checked (an empty batch proves nothing about
        # ORT's write, so the next step verifies again)
        self.verified = verify and all(n > 0 for _, n in ran)
        if not ran:
            return run()
        if eager is not None and all(n == 0 for _, n in ran):
            self.verified = False
            return eager()
        means: list[torch.Tensor] = []
        vars_: list[torch.Tensor] = []
        for m, _ in ran:
            assert m.running_mean is not None and m.running_var is not None  # tracked
            means.append(m.running_mean)
            vars_.append(m.running_var)
        with torch.no_grad():
            old_means = torch._foreach_mul(means, 1.0)
            old_vars = torch._foreach_mul(vars_, 1.0)
            checked = [m for m, n in ran if n > 0] if verify else []
            for mean, (_, n) in zip(means, ran, strict=True):
                if verify and n > 0:
                    mean.fill_(_SENTINEL)
        try:
            out = run()
            missed = [
                name
                for name, m in tracked
                if any(m is c for c in checked)
                and (stat := m.running_mean) is not None
                and bool((stat == _SENTINEL).any())
            ]
            if missed:
                raise StatsNotWrittenError(
                    "bnswap.ort: ONNX Runtime did not write the batch statistics of "
                    f"{missed} into their running_mean buffers (BatchNormInternal's "
                    "aliased outputs); their running statistics cannot follow PyTorch's "
                    "rule. Use backend='aten' for this model."
                )
        except BaseException:
            with torch.no_grad():
                torch._foreach_copy_(means, old_means)
                torch._foreach_copy_(vars_, old_vars)
            raise
        with torch.no_grad():
            for m, _ in ran:
                if m.num_batches_tracked is not None:
                    m.num_batches_tracked.add_(1)
            full = [i for i, (_, n) in enumerate(ran) if n > 0]
            empty = [i for i, (_, n) in enumerate(ran) if n == 0]
            if empty:
                # An empty batch (n == 0): stock leaves the statistics as they were and
                # still counts the batch (aten::batch_norm returns early); ORT wrote NaN
                # batch statistics into the buffers.
                torch._foreach_copy_([means[i] for i in empty], [old_means[i] for i in empty])
                torch._foreach_copy_([vars_[i] for i in empty], [old_vars[i] for i in empty])
            if full:
                ms = [
                    float(
                        exponential_average_factor(
                            ran[i][0].momentum, ran[i][0].num_batches_tracked
                        )
                    )
                    for i in full
                ]
                keep = [1.0 - w for w in ms]
                scale_v = [w * ran[i][1] / (ran[i][1] - 1) for w, i in zip(ms, full, strict=True)]
                fm, fv = [means[i] for i in full], [vars_[i] for i in full]
                # running = m * batch + (1 - m) * old   (the batch's are in the buffer)
                torch._foreach_mul_(fm, ms)
                torch._foreach_add_(fm, torch._foreach_mul([old_means[i] for i in full], keep))
                torch._foreach_mul_(fv, scale_v)
                torch._foreach_add_(fv, torch._foreach_mul([old_vars[i] for i in full], keep))
        return out


def detach_tree(out: Any) -> Any:
    """``out`` with every tensor detached (outputs of a training graph run under no_grad)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)
