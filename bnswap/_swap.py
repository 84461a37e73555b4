"""The swap primitive: one BatchNorm layer runs bnswap's forward, its class unchanged.

:func:`swap` marks the layer: a :class:`Swap` (the adapter, and the class whose
``forward`` it replaces) in its instance ``__dict__`` under :data:`SWAP`. That class's
``forward`` is bnswap's *dispatcher* (put there once per class, at the first swap:
:func:`dispatch_on`): for a marked layer it runs ``adapter(self, input)``, for any other
layer the class's own ``forward``. So the layer runs the consolidated ops while
``type(layer)`` stays the stock class, and the module, its Parameters, buffers, hooks and
state_dict keys are untouched. :func:`unswap` deletes the mark: the exact inverse. Where a
consumer records the model for another runtime (the TorchScript tracer,
``torch.onnx.export``, fx tracing through a non-leaf layer) the dispatcher runs the
class's own ``forward``, so that consumer gets stock's graph. Why this design and what it
costs: ``docs/design.md``.

What the mark means where it is carried (issue 32; the rule: state that a copy or a
checkpoint carries means the same thing there, or is not there at all). The mark names no
layer: the dispatcher runs the adapter on whichever module it is called on (``self``), so
every copy that carries it runs its own state:

* ``copy.deepcopy``: the copy is swapped.
* A copy of the layer's ``__dict__`` (learn2learn's ``clone_module``, higher's
  ``monkeypatch``, ``nn.DataParallel``'s replicas): the copy is swapped and runs its own
  parameters and buffers, called as ``copy(x)``, ``copy.forward(x)``, from another
  thread or inside ``torch.compile``.
* ``torch.save`` / pickle of a whole model and ``copy.copy``: no mark (the
  ``checkpoints`` patch, :mod:`bnswap._compat.checkpoints`): a checkpoint names nothing of
  bnswap's and loads as stock's layers, where bnswap is not installed too. A pickle for
  another process of the job (multiprocessing) keeps it: unpickling a :class:`Swap`
  puts the dispatcher on its class in that process.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.utils import parametrize

from bnswap._warn import warn
from bnswap.functional import records_consolidated_ops

__all__ = [
    "INTERNAL_BUFFER_PREFIX",
    "INTERNAL_HOOK",
    "SWAP",
    "WRAPPER_STATE",
    "Adapter",
    "Swap",
    "adapter_of",
    "add_internal_buffer",
    "bypass_message",
    "bypass_of",
    "class_forward",
    "dispatch_on",
    "dispatches",
    "drop_internal_buffers",
    "forget_compiled_code",
    "forward_owner",
    "internal_buffer_names",
    "is_swapped",
    "on_first_swap",
    "stood_for",
    "swap",
    "type_before_parametrizations",
    "undo_of",
    "unpickle_swap",
    "unswap",
    "wrapped_model",
]

#: The instance attribute (in ``__dict__``) where a bnswap backend wrapper (e.g. the one
#: :mod:`bnswap.ort` returns) keeps its state; the state's ``model`` is the model it wraps.
WRAPPER_STATE = "_bnswap"

#: Attribute (true) of a forward pre-hook a bnswap backend puts on a user's module (e.g.
#: a warning of :mod:`bnswap.ort`): views for other runtimes (TorchScript,
#: ``bnswap._compat.torchscript.stock_view``) leave such hooks out.
INTERNAL_HOOK = "_bnswap_internal_hook"

#: The prefix of every internal buffer's name (:func:`add_internal_buffer`): a buffer so
#: named is bnswap's. A name, not a record kept anywhere, so that it is recognized on
#: every copy of a layer: the new module objects ``torch.jit.trace`` builds (the buffers
#: and nothing else), a layer unpickled where its backend is not imported.
INTERNAL_BUFFER_PREFIX = "_bnswap_"

#: The instance attribute (in a swapped layer's ``__dict__``) that holds its
#: :class:`Swap`; the class attribute of the same name is None (set where the dispatcher
#: is put), so reading it costs a plain attribute lookup on every layer. Starts with
#: :data:`INTERNAL_BUFFER_PREFIX`: pickles and views for other runtimes leave it out.
SWAP = "_bnswap_swap"

#: An adapter: ``adapter(layer, input, ...)`` does what ``type(layer).forward(layer, input,
#: ...)`` does, with the batch norm on bnswap's kernel (see :mod:`bnswap.layers`).
Adapter = Callable[..., Any]

#: Attribute (the class's own forward) of a dispatcher :func:`dispatch_on` made.
_ORIGINAL = "_bnswap_original_forward"


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
    """Run ``hook()`` when this process first puts bnswap's dispatcher on a class (the
    first swap, a swapped layer unpickled or deep-copied), or now if it did already.
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


def _records_stock(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call is being recorded for another runtime (see the module docstring).

    On every forward: the checks are ordered and written for eager's cost (benchmarks P3).
    Under dynamo the first returns (it folds ``is_compiling`` to a constant), so the
    TorchScript tracer's C flag, read directly (``torch.jit.is_tracing`` adds two Python
    calls), is never traced."""
    if torch.compiler.is_compiling():  # dynamo or torch.export: a constant per graph
        return torch.onnx.is_in_onnx_export()
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


class Swap:
    """The mark of a swapped layer (``layer.__dict__[SWAP]``): run ``adapter`` where
    ``owner.forward`` would run.

    Args:
        adapter: the function that runs the layer on bnswap's kernel
            (:func:`bnswap.layers.batch_norm_forward` for torch's classes).
        owner: the class whose ``forward`` the adapter replaces (:func:`forward_owner`
            of the layer's class: ``_BatchNorm`` for ``nn.BatchNorm2d``); its
            ``forward`` is the dispatcher.

    Immutable and shared: copies of a layer share it (it names no layer). Unpickling one
    (a pickle for another process of the job) puts the dispatcher on ``owner`` there.
    """

    __slots__ = ("adapter", "owner")

    def __init__(self, adapter: Adapter, owner: type) -> None:
        self.adapter = adapter
        self.owner = owner

    def __reduce__(self) -> tuple[Any, ...]:
        keeps = pickle_keeps_swap
        if keeps is not None and not keeps():
            # pickled with its layer's state where the layer's __getstate__ did not
            # leave it out (a subclass with a __getstate__ of its own, the checkpoints
            # patch on): None, which any Python unpickles, and an unswapped layer
            return (type(None), ())
        return (unpickle_swap, (self.adapter, self.owner))

    def __copy__(self) -> Swap:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Swap:
        return self

    def __repr__(self) -> str:
        name = getattr(self.adapter, "__qualname__", repr(self.adapter))
        return f"<bnswap swap: {self.owner.__name__}.forward -> {name}>"


#: Set by the ``checkpoints`` patch (:mod:`bnswap._compat.checkpoints`): called while a
#: :class:`Swap` is pickled, False where the pickle is a checkpoint (the swap is left out:
#: it unpickles as None) rather than a copy for this job (deepcopy, multiprocessing).
pickle_keeps_swap: Callable[[], bool] | None = None


def unpickle_swap(adapter: Adapter, owner: type) -> Swap:
    """A :class:`Swap` from a pickle (its ``__reduce__``), the dispatcher put on
    ``owner`` in this process first."""
    dispatch_on(owner)
    return Swap(adapter, owner)


#: forward_owner's answers, per class (the MRO walk cost ~0.9 us per swapped layer).
_OWNERS: dict[type, type] = {}


def forward_owner(cls: type) -> type:
    """The class in ``cls``'s MRO whose ``forward`` a layer of ``cls`` runs (``_BatchNorm``
    for ``nn.BatchNorm2d`` and torch's parametrized and lazy classes; ``SyncBatchNorm``;
    timm's ``BatchNormAct2d`` itself). Memoized per class (a class's MRO does not
    change, and the dispatcher replaces a ``forward`` in the same class), and checked
    against ``cls.forward``: a class-level patch that gives a class below the memoized
    owner a ``forward`` of its own (``nn.BatchNorm2d.forward = f``, issue 46) moves it."""
    owner = _OWNERS.get(cls)
    if owner is None or getattr(cls, "forward", None) is not owner.__dict__.get("forward"):
        owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
        if owner is None:
            raise TypeError(f"{cls.__name__} has no forward")
        _OWNERS[cls] = owner
    return owner


def class_forward(cls: type[nn.Module]) -> Callable[..., Any]:
    """``cls.forward`` as its class defined it (the function the dispatcher stands for):
    stock's forward, for views and the consumers that record it."""
    fn = cls.forward
    return getattr(fn, _ORIGINAL, fn)


def stood_for(fn: Any) -> Any:
    """The function bnswap's dispatcher ``fn`` stands for (the class's own forward), or
    ``fn`` itself when it is no dispatcher."""
    return getattr(fn, _ORIGINAL, fn)


def dispatches(cls: type) -> bool:
    """True if ``cls.forward`` is bnswap's dispatcher (:func:`dispatch_on`)."""
    return getattr(getattr(cls, "forward", None), _ORIGINAL, None) is not None


_lock = threading.Lock()


def dispatch_on(owner: type) -> None:
    """Put bnswap's dispatcher on ``owner`` (once; thread-safe): ``owner.forward`` becomes
    a function that runs ``swap.adapter(self, ...)`` for a layer marked with a
    :class:`Swap` of this ``owner`` (and not being recorded for another runtime, see the
    module docstring), else ``owner``'s own forward. Unmarked layers pay one attribute
    lookup (benchmarks P3). The first call in the process runs :func:`on_first_swap`'s
    hooks."""
    if getattr(owner.__dict__.get("forward"), _ORIGINAL, None) is not None:
        return
    with _lock:
        original = owner.__dict__.get("forward")
        if getattr(original, _ORIGINAL, None) is not None:
            return
        if original is None:
            raise TypeError(f"{owner.__name__} defines no forward")

        forward = (_one_input if _takes_one_input(original) else _any_inputs)(owner, original)
        setattr(forward, _ORIGINAL, original)
        if not hasattr(owner, SWAP):
            setattr(owner, SWAP, None)
        owner.forward = forward  # type: ignore[attr-defined]  # any class with a forward
    # Code torch.compile cached before this moment inlined the class's own forward with
    # no guard on it: it would keep running stock's ops, silently, for swapped layers.
    forget_compiled_code(owner)
    if not _swapped_once:
        _first_swap()


def forget_compiled_code(owner: type) -> int:
    """Invalidate the code ``torch.compile`` (dynamo) has cached in this process, after
    ``owner.forward`` changed (:func:`dispatch_on`); return how many code objects had a
    cache (0: nothing compiled yet, nothing done, dynamo not imported).

    Dynamo guards a module's instance attributes, not its class's ``forward``: a frame
    compiled before the change keeps the inlined stock forward for every layer, swapped
    or not, and a new model of the same structure reuses it. This runs once per class
    and process (the first swap, or the first swapped layer unpickled); each frame
    compiled before recompiles at its next call (the cost: one compile, on the same
    graph for models bnswap never touched). ``torch._dynamo.reset_code_caches`` drops
    the compiled code only (dynamo's counters and configuration stay). A warning says so,
    naming the fix: convert before compiling.
    """
    dynamo = sys.modules.get("torch._dynamo")
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if dynamo is None or convert_frame is None:
        return 0
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", None)
    codes = [c for c in (w() for w in (seen or ())) if c is not None]
    entries = getattr(
        sys.modules.get("torch._dynamo.eval_frame"), "_debug_get_cache_entry_list", None
    )
    if entries is not None:  # the frames that hold compiled code (the rest were skipped)
        codes = [c for c in codes if entries(c)]
    if not codes:
        return 0
    reset = getattr(dynamo, "reset_code_caches", None) or dynamo.reset
    reset()
    warn(
        f"bnswap: {owner.__name__}.forward changed at this process's first swap of such a "
        f"layer, after torch.compile had compiled {len(codes)} frame(s): their cached code "
        "was invalidated and recompiles at its next call, on bnswap's ops for swapped "
        "layers and stock's for the rest. Convert models before compiling anything to "
        "avoid the recompile.",
        RuntimeWarning,
    )
    return len(codes)


def _takes_one_input(fn: Callable[..., Any]) -> bool:
    """``fn(self, input)`` and nothing else, by that name (torch's classes: their
    dispatcher skips the ``*args`` / ``**kwargs`` packing on every call, and takes
    ``input`` by keyword as theirs does)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return (
        len(params) == 2
        and params[1].name == "input"
        and all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)
    )


def _one_input(owner: type, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, input: Any) -> Any:
        swap: Swap | None = self._bnswap_swap  # type: ignore[assignment]  # nn.Module.__getattr__ -> Tensor | Module
        if swap is None or swap.owner is not owner:
            return original(self, input)
        if torch.compiler.is_compiling():  # dynamo or torch.export: a constant per graph
            if torch.onnx.is_in_onnx_export():
                return original(self, input)
        elif (_is_tracing() or isinstance(input, _Proxy)) and _records_stock((input,), {}):
            return original(self, input)
        return swap.adapter(self, input)

    return forward


def _any_inputs(owner: type, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        swap: Swap | None = self._bnswap_swap  # type: ignore[assignment]  # nn.Module.__getattr__ -> Tensor | Module
        if swap is None or swap.owner is not owner or _records_stock(args, kwargs):
            return original(self, *args, **kwargs)
        return swap.adapter(self, *args, **kwargs)

    return forward


def _mark(module: object) -> Swap | None:
    swap = getattr(module, "__dict__", {}).get(SWAP)
    return swap if type(swap) is Swap else None


def bypass_of(module: object) -> tuple[type, Callable[..., Any]] | None:
    """For a layer marked as swapped whose class's ``forward`` was replaced after the
    swap, so that bnswap's dispatcher no longer runs for it (issue 46: test-time
    adaptation code such as MEMO sets ``nn.BatchNorm2d.forward`` or
    ``_BatchNorm.forward`` to a function of its own): the class that holds the function
    that runs, and that function. None for a layer that is not marked or still
    dispatches.

    Two replacements are seen: the owner's dispatcher itself replaced
    (``_BatchNorm.forward = f``, or a registered class's), and a ``forward`` put on one of
    torch's classes below the owner (``nn.BatchNorm2d.forward = f``). A subclass made
    from the layer's class after the swap (higher's ``monkeypatch``: its ``forward``
    calls the class's, bnswap's dispatcher) is no replacement."""
    swap = _mark(module)
    return None if swap is None else _bypass(module, swap)


def _bypass(module: object, swap: Swap) -> tuple[type, Callable[..., Any]] | None:
    cls = type(module)
    dispatcher = swap.owner.__dict__.get("forward")
    runs = cls.forward  # type: ignore[attr-defined]  # a marked module is an nn.Module
    if runs is dispatcher and hasattr(runs, _ORIGINAL):
        return None  # (the common case: one identity test)
    if not hasattr(dispatcher, _ORIGINAL):
        return swap.owner, dispatcher  # type: ignore[return-value]  # the owner keeps a forward
    holder = next(k for k in cls.__mro__ if "forward" in vars(k))
    if holder is not swap.owner and holder.__module__.startswith("torch.nn.modules"):
        return holder, runs
    return None


#: (class, function) pairs :func:`_live` has warned about: once each per process.
_BYPASS_WARNED: set[tuple[type, Any]] = set()


def bypass_message(holder: type, fn: Callable[..., Any]) -> str:
    """The warning for layers whose swap :func:`bypass_of` finds bypassed."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return (
        f"bnswap: {holder.__name__}.forward was replaced after bnswap swapped layers that "
        f"run it (by {name}, a class-level patch): that function runs for them, not "
        "bnswap's forward (which runs only where that function calls the forward it "
        "replaced). bnswap.is_swapped(layer) is False for them and bnswap.plan skips them; "
        "to run your function on bnswap's kernel, register an adapter that does what it "
        "does (bnswap.register(<class>, <function>), see the 'Adapters' guide of bnswap's "
        "documentation) and convert again"
    )


def _live(module: object, swap: Swap | None) -> bool:
    """Whether the marked ``module`` runs bnswap's forward (False, with a warning once
    per replacement, when its class's forward was replaced: :func:`bypass_of`)."""
    if swap is None:
        return False
    found = _bypass(module, swap)
    if found is None:
        return True
    key = (found[0], found[1])
    if key not in _BYPASS_WARNED:
        _BYPASS_WARNED.add(key)
        warn(bypass_message(*found), UserWarning)
    return False


def is_swapped(module: object) -> bool:
    """True if ``module`` runs bnswap's forward (:func:`bnswap.convert` swapped it, or it
    is a copy of a swapped layer). False for a swapped layer whose class's ``forward``
    was replaced since (a class-level patch such as ``nn.BatchNorm2d.forward = f``: that
    function runs; a warning says so, once per replacement; issue 46).

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> bn = nn.BatchNorm2d(8)
        >>> bnswap.is_swapped(bn), bnswap.is_swapped(bnswap.convert(bn))
        (False, True)
        >>> type(bn) is nn.BatchNorm2d     # the class never changes
        True
    """
    swap = _mark(module)
    return swap is not None and _live(module, swap)


def adapter_of(module: object) -> Adapter | None:
    """The adapter ``module`` runs, or None when it is not swapped (:func:`is_swapped`)."""
    swap = _mark(module)
    return swap.adapter if swap is not None and _live(module, swap) else None


def undo_of(module: nn.Module) -> Callable[[], None]:
    """What undoes :func:`swap` on ``module`` (taken before it): puts back the mark it had
    (a swapped layer swapped again), or drops it."""
    d = module.__dict__
    before = d.get(SWAP)

    def undo() -> None:
        if before is None:
            d.pop(SWAP, None)
        else:
            d[SWAP] = before

    return undo


def swap(module: nn.Module, adapter: Adapter) -> None:
    """Make ``module`` run ``adapter(module, ...)`` as its forward (take
    :func:`undo_of` first to be able to put it back).

    A layer that is already swapped gets the new adapter. Uninitialized lazy layers
    (``nn.LazyBatchNorm2d``...) keep the mark when they initialize (torch changes their
    ``__class__``, never their ``__dict__``, and both classes run ``_BatchNorm.forward``).
    """
    owner = forward_owner(type_before_parametrizations(module))
    dispatch_on(owner)
    # The instance dict directly: nn.Module.__setattr__ would only check, slowly, that
    # the value is no Parameter / Module / buffer before doing the same (benchmarks P5).
    module.__dict__[SWAP] = Swap(adapter, owner)


def unswap(module: nn.Module) -> None:
    """Give ``module`` its class's forward back and drop its internal buffers
    (:func:`add_internal_buffer`); a module that is not swapped keeps its forward."""
    if _mark(module) is not None:
        del module.__dict__[SWAP]
    drop_internal_buffers(module)


def add_internal_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as the non-persistent buffer ``name`` of ``module``: an
    internal buffer, one a bnswap backend attaches to a swapped layer for its own runtime
    (e.g. :mod:`bnswap.ort`'s per-layer stand-ins of an affine=False layer).

    An internal buffer is never in the state_dict (non-persistent); every view of the
    model for another runtime (TorchScript's: ``torch.jit.script`` / ``trace``,
    ``bnswap._compat.torchscript.stock_view``) leaves it out, and :func:`unswap` (so
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
        raise ValueError(
            f"bnswap: an internal buffer's name starts with "
            f"{INTERNAL_BUFFER_PREFIX!r}, got {name!r}"
        )
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
