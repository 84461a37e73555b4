"""The swap primitive: one BatchNorm layer runs bnswap's forward, its class unchanged.

:func:`swap` stores a :class:`SwappedForward` in the layer's instance ``__dict__`` under
``"forward"``; ``nn.Module.__call__`` looks ``self.forward`` up on the instance before the
class, so the layer runs an adapter on the consolidated ops while ``type(layer)`` stays
the stock class, and the module, its Parameters, buffers, hooks and state_dict keys are
untouched. :func:`unswap` deletes the entry: the exact inverse. Where a consumer records
the model for another runtime (the TorchScript tracer, ``torch.onnx.export``, fx tracing
through a non-leaf layer) the layer runs its class's own ``forward``, so that consumer
gets stock's graph. Why this design and what it costs: ``docs/design.md``.

What the entry means where it is carried (issue 32; the rule: state that a copy or a
checkpoint carries means the same thing there, or is not there at all):

* ``copy.deepcopy``: the copy's entry is bound to the copy.
* ``torch.save`` / pickle of a whole model and ``copy.copy``: no entry (the
  ``checkpoints`` patch of :mod:`bnswap._compat`): a checkpoint names nothing of
  bnswap's and loads as stock's layers, where bnswap is not installed too.
* A copy of the layer's ``__dict__`` (learn2learn's ``clone_module``, higher's
  ``monkeypatch``, ``nn.DataParallel``'s replicas) carries the entry bound to the
  original; when such a copy calls it, :meth:`SwappedForward.__call__` sees (the entry
  then has another holder, ``sys.getrefcount``; the frame of ``nn.Module.__call__`` says
  which module called) and runs the copy's own state: the adapter, or the copy's class's
  forward where that class overrides the layer's (higher's). Not seen while dynamo
  traces: a ``torch.compile``'d ``__dict__`` copy runs the original layer
  (``docs/recipes.md``).
"""

from __future__ import annotations

import copy
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.utils import parametrize

from bnswap.functional import records_consolidated_ops

__all__ = ["Adapter", "INTERNAL_BUFFER_PREFIX", "INTERNAL_HOOK", "SwappedForward",
           "WRAPPER_STATE", "adapter_of", "add_internal_buffer", "bound_elsewhere",
           "drop_internal_buffers", "internal_buffer_names", "is_swapped", "on_first_swap",
           "swap", "type_before_parametrizations", "undo_of", "unswap", "wrapped_model"]

#: The instance attribute (in ``__dict__``) where a bnswap backend wrapper (e.g. the one
#: :mod:`bnswap.ort` returns) keeps its state; the state's ``model`` is the model it wraps.
WRAPPER_STATE = "_bnswap"

#: Attribute (true) of a forward pre-hook a bnswap backend puts on a user's module (e.g.
#: a warning of :mod:`bnswap.ort`): views for other runtimes (TorchScript,
#: ``bnswap._compat.stock_view``) leave such hooks out.
INTERNAL_HOOK = "_bnswap_internal_hook"

#: The prefix of every internal buffer's name (:func:`add_internal_buffer`): a buffer so
#: named is bnswap's. A name, not a record kept anywhere, so that it is recognized on
#: every copy of a layer: the new module objects ``torch.jit.trace`` builds (the buffers
#: and nothing else), a layer unpickled where its backend is not imported.
INTERNAL_BUFFER_PREFIX = "_bnswap_"

#: An adapter: ``adapter(layer, input, ...)`` does what ``type(layer).forward(layer, input,
#: ...)`` does, with the batch norm on bnswap's kernel (see :mod:`bnswap.layers`).
Adapter = Callable[..., Any]


def type_before_parametrizations(module: nn.Module) -> type:
    """``torch.nn.utils.parametrize.type_before_parametrizations``, fast for the common
    unparametrized module: torch registers parametrizations as the submodule
    ``parametrizations``, and looking in ``_modules`` first skips ``nn.Module.__getattr__``'s
    AttributeError path, which dominated ``convert`` on large models (11 of 14 us per
    layer at 10,000 layers; benchmarks P5)."""
    if "parametrizations" in module._modules:
        return parametrize.type_before_parametrizations(module)
    return type(module)


_first_swap_hooks: list[Callable[[], None]] = []
_swapped_once = False


def on_first_swap(hook: Callable[[], None]) -> None:
    """Run ``hook()`` when the first :class:`SwappedForward` of this process is made (a
    swap, a swapped layer unpickled or deep-copied), or now if one was made already.
    ``bnswap._compat`` applies its patches this way: ``import bnswap`` changes nothing in
    torch or any other library until the process holds a swapped layer."""
    _first_swap_hooks.append(hook)
    if _swapped_once:
        hook()


def _first_swap() -> None:
    global _swapped_once
    _swapped_once = True
    for hook in _first_swap_hooks:
        hook()


_is_tracing = torch._C._is_tracing
_Proxy = torch.fx.Proxy


def _records_stock(args: tuple, kwargs: dict) -> bool:
    """Whether this call is being recorded for another runtime (see the module docstring).

    On every forward: the checks are ordered and written for eager's cost (benchmarks P3).
    Under dynamo the first returns (it folds ``is_compiling`` to a constant), so the
    TorchScript tracer's C flag, read directly (``torch.jit.is_tracing`` adds two Python
    calls), is never traced."""
    if torch.compiler.is_compiling():  # dynamo or torch.export: a constant per graph
        return torch.onnx.is_in_onnx_export()
    return _records_stock_eager(args, kwargs)


def _records_stock_eager(args: tuple, kwargs: dict) -> bool:
    """:func:`_records_stock` outside dynamo."""
    if _is_tracing():
        return not records_consolidated_ops()
    # fx tracing through a layer that is not a leaf: any argument may be the Proxy
    for a in args:
        if isinstance(a, _Proxy):
            return True
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, _Proxy):
                return True
    return False


class SwappedForward:
    """The ``forward`` bnswap installs on one layer: ``adapter(layer, *args)``.

    Args:
        module: the BatchNorm layer (a ``torch.nn.modules.batchnorm._BatchNorm``).
        adapter: the function that runs it on bnswap's kernel
            (:func:`bnswap.layers.batch_norm_forward` for torch's classes).

    Calls take and return what ``module``'s own ``forward`` does: input (N, C, *) of a
    floating dtype, output of the same shape, dtype and memory format. Deep-copied with
    the layer (bound to the copy); left out of the layer's pickle and ``copy.copy``
    (:mod:`bnswap._compat`'s ``checkpoints`` patch; without it, pickled by reference).
    """

    __slots__ = ("module", "adapter")

    def __init__(self, module: nn.Module, adapter: Adapter) -> None:
        # Touches nothing on `module`: unpickling builds this before the module's state.
        self.module = module
        self.adapter = adapter
        if not _swapped_once:
            _first_swap()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if torch.compiler.is_compiling():  # dynamo or torch.export: a constant per graph
            if torch.onnx.is_in_onnx_export():
                return type(module).forward(module, *args, **kwargs)
            return self.adapter(module, *args, **kwargs)
        # Held by more than its layer's __dict__ (and this call): maybe a copy of that
        # __dict__ is calling (see the module docstring). A C call: +0.02 us per call
        # (docs/design.md).
        if _getrefcount(self) > _SOLE_HOLDER:
            caller = _calling_module()
            if caller is not None and caller is not module:
                return _run_copy(self, caller, args, kwargs)
        if _records_stock_eager(args, kwargs):
            return type(module).forward(module, *args, **kwargs)
        return self.adapter(module, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (SwappedForward, (self.module, self.adapter))

    # What code that inspects a module's ``forward`` reads sees the class's own forward:
    # torch.export of a converted layer as the root module reads ``forward.__code__``
    # (its fake-input names) and ``inspect.signature(forward)`` (the program's input
    # names: ``input``, as stock's program).
    @property
    def __code__(self) -> Any:
        return type(self.module).forward.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __deepcopy__(self, memo: dict) -> SwappedForward:
        return SwappedForward(copy.deepcopy(self.module, memo), self.adapter)

    def __repr__(self) -> str:
        name = getattr(self.adapter, "__qualname__", repr(self.adapter))
        return f"<bnswap forward of {type(self.module).__name__} ({name})>"


_getrefcount = sys.getrefcount
_getframe = sys._getframe
# The frames of nn.Module that call ``self.forward``: ``_call_impl`` (no hooks), its
# ``inner`` (with hooks) and ``_slow_forward`` (the TorchScript tracer); ``self`` is a
# local (or cell) of each.
_CALLERS = frozenset([nn.Module._call_impl.__code__, nn.Module._slow_forward.__code__,
                      *(c for c in nn.Module._call_impl.__code__.co_consts
                        if isinstance(c, types.CodeType))])


def _calling_module() -> object:
    """The module whose ``nn.Module.__call__`` called the current ``SwappedForward`` (two
    frames up), or None when the call came from elsewhere (``layer.forward(x)`` by hand)."""
    frame = _getframe(2)
    if frame.f_code not in _CALLERS:
        return None
    return frame.f_locals.get("self")


def _run_copy(entry: SwappedForward, caller: Any, args: tuple, kwargs: dict) -> Any:
    """A module other than ``entry.module`` called ``entry``: it holds a copy of the
    layer's ``__dict__`` (``clone.__dict__ = layer.__dict__.copy()``: learn2learn's
    ``clone_module``, higher's ``monkeypatch``, ``nn.DataParallel``'s replicas). It runs
    its own state, never the layer's: bnswap's adapter if its class's forward is the
    layer's (bnswap's kernel, stock's results), else its own class's forward (higher's
    patched class, which runs stock's on its own parameters)."""
    cls = type(caller)
    if cls.forward is not type(entry.module).forward or _records_stock(args, kwargs):
        return cls.forward(caller, *args, **kwargs)
    return entry.adapter(caller, *args, **kwargs)


def _sole_holder_count() -> int:
    """``sys.getrefcount`` of a ``SwappedForward`` inside its ``__call__`` when only its
    layer's ``__dict__`` holds it, measured on this interpreter (it differs between
    Python versions): the most over the ways ``nn.Module`` calls a forward (with and
    without hooks)."""
    seen: list[int] = []

    class Probe:  # SwappedForward's shape: slots, __call__(self, *args, **kwargs)
        __slots__ = ("module", "adapter")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(_getrefcount(self))
            return args[0]

    layer = nn.Identity()
    layer.__dict__["forward"] = Probe()
    x = object()
    layer(x)
    handle = layer.register_forward_pre_hook(lambda m, a: None)
    layer(x)
    handle.remove()
    return max(seen)


#: What :func:`_sole_holder_count` measured: a higher count in ``SwappedForward.__call__``
#: means another holder (a copied ``__dict__``, a reference kept by hand), and the frame
#: of ``nn.Module.__call__`` says which module called.
_SOLE_HOLDER = _sole_holder_count()


def _entry(module: object) -> SwappedForward | None:
    fwd = getattr(module, "__dict__", {}).get("forward")
    return fwd if type(fwd) is SwappedForward else None


def is_swapped(module: object) -> bool:
    """True if ``module`` runs bnswap's forward (:func:`bnswap.convert` swapped it).

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> bn = nn.BatchNorm2d(8)
        >>> bnswap.is_swapped(bn), bnswap.is_swapped(bnswap.convert(bn))
        (False, True)
        >>> type(bn) is nn.BatchNorm2d     # the class never changes
        True
    """
    return _entry(module) is not None


def adapter_of(module: object) -> Adapter | None:
    """The adapter ``module`` runs, or None when it is not swapped."""
    entry = _entry(module)
    return None if entry is None else entry.adapter


def undo_of(module: nn.Module) -> Callable[[], None]:
    """What undoes :func:`swap` on ``module`` (taken before it): puts back the instance
    ``forward`` it had (a shallow copy's entry, still bound to the layer it was copied
    from), or drops it, so the class's runs again. :func:`bnswap.plan` skips layers with
    an instance forward of their own."""
    d = module.__dict__
    before = d.get("forward")

    def undo() -> None:
        if before is None:
            d.pop("forward", None)
        else:
            d["forward"] = before

    return undo


def bound_elsewhere(module: object) -> bool:
    """True if ``module`` holds a swap entry bound to another layer: a copy of a swapped
    layer's ``__dict__`` (learn2learn's ``clone_module``, ``nn.DataParallel``'s replicas)
    shares its entry; called through the copy, the entry runs the copy's own state (see
    the module docstring), and :func:`bnswap.convert` binds it to the copy."""
    entry = _entry(module)
    return entry is not None and entry.module is not module


def swap(module: nn.Module, adapter: Adapter) -> None:
    """Make ``module`` run ``adapter(module, ...)`` as its forward (take
    :func:`undo_of` first to be able to put it back).

    A layer that is already swapped gets the new adapter. Uninitialized lazy layers
    (``nn.LazyBatchNorm2d``...) keep the entry when they initialize (torch changes their
    ``__class__``, never their ``__dict__``).
    """
    # The instance dict directly: nn.Module.__setattr__ would only check, slowly, that
    # the value is no Parameter / Module / buffer before doing the same (benchmarks P5).
    module.__dict__["forward"] = SwappedForward(module, adapter)


def unswap(module: nn.Module) -> None:
    """Give ``module`` its class's forward back and drop its internal buffers
    (:func:`add_internal_buffer`); a module that is not swapped keeps its forward."""
    if _entry(module) is not None:
        del module.__dict__["forward"]
    drop_internal_buffers(module)


def add_internal_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as the non-persistent buffer ``name`` of ``module``: an
    internal buffer, one a bnswap backend attaches to a swapped layer for its own runtime
    (e.g. :mod:`bnswap.ort`'s per-layer stand-ins of an affine=False layer).

    An internal buffer is never in the state_dict (non-persistent); every view of the
    model for another runtime (TorchScript's: ``torch.jit.script`` / ``trace``,
    ``bnswap._compat.stock_view``) leaves it out, and :func:`unswap` (so
    :func:`bnswap.revert`) removes it. Its name starts with
    :data:`INTERNAL_BUFFER_PREFIX`, which is how each of them recognizes it. A name
    registered again replaces the tensor.

    Args:
        module: the layer (any ``nn.Module``).
        name: the buffer's name, starting with :data:`INTERNAL_BUFFER_PREFIX`
            (``"_bnswap_"``).
        tensor: the buffer, any shape, dtype and device.

    Raises:
        ValueError: ``"bnswap: an internal buffer's name starts with '_bnswap_', got
            ..."``, before anything is registered.
        What ``nn.Module.register_buffer`` raises: ``KeyError`` (``"attribute '...'
            already exists"`` for an attribute that is no buffer, a name with a dot),
            ``TypeError`` (a name that is no string, a tensor that is no Tensor).

    Examples::

        >>> import torch, bnswap
        >>> from bnswap._swap import add_internal_buffer, internal_buffer_names
        >>> bn = bnswap.convert(torch.nn.BatchNorm1d(2, affine=False))
        >>> add_internal_buffer(bn, "_bnswap_ones", torch.ones(2))
        >>> internal_buffer_names(bn), "_bnswap_ones" in bn.state_dict()
        (['_bnswap_ones'], False)
        >>> _ = bnswap.revert(bn)
        >>> internal_buffer_names(bn), hasattr(bn, "_bnswap_ones")
        ([], False)
    """
    if isinstance(name, str) and not name.startswith(INTERNAL_BUFFER_PREFIX):
        raise ValueError(f"bnswap: an internal buffer's name starts with "
                         f"{INTERNAL_BUFFER_PREFIX!r}, got {name!r}")
    module.register_buffer(name, tensor, persistent=False)


def internal_buffer_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s internal buffers (:func:`add_internal_buffer`), in
    registration order."""
    return [k for k in module._buffers if k.startswith(INTERNAL_BUFFER_PREFIX)]


def drop_internal_buffers(module: nn.Module, names: Iterable[str] | None = None) -> None:
    """Remove ``module``'s internal buffers (:func:`add_internal_buffer`): those of
    ``names`` (None: all of them). Other buffers are left alone."""
    internal = internal_buffer_names(module)
    if not internal:
        return
    if names is not None:
        wanted = set(names)
        internal = [k for k in internal if k in wanted]
    for name in internal:
        del module._buffers[name]
        module._non_persistent_buffers_set.discard(name)


def wrapped_model(module: object) -> nn.Module | None:
    """The model inside ``module`` if it is a bnswap backend wrapper (e.g. what
    ``bnswap.convert(..., backend="ort")`` returns), else None; read without importing
    the backend (:data:`WRAPPER_STATE`)."""
    state = getattr(module, "__dict__", {}).get(WRAPPER_STATE)
    model = getattr(state, "model", None)
    return model if isinstance(model, nn.Module) else None
