"""``bnswap.programs``: exported programs and graph modules, in both directions.

bnswap's layers record the consolidated batch-norm ops in training
(``aten._batch_norm_with_update`` / ``batch_norm_backward``, pytorch PR 116092) and
stock's ``aten.batch_norm`` in evaluation when a converted model is exported. A graph
made without bnswap (a ``torch.export`` program of a stock model, a ``.pt2`` file someone
sent) records stock's ops: ``aten.batch_norm`` (``cudnn_enabled=False``: ``torch.export``
traces with cuDNN off), which selects its kernel at run time all the same (torch ignores
that argument), or, in AOT graphs and after ``run_decompositions()``, the
``_native_batch_norm_legit*`` ops, which bind the native kernel on CUDA
(:mod:`bnswap.kernels`). The two directions of one rewrite:

* :func:`convert` (``bnswap.convert(program)``): stock's batch-norm nodes become the ops
  a swapped layer runs, which pick cuDNN / MIOpen / native when they run;
* :func:`bnswap.to_stock_ops`: bnswap's nodes become stock's, for graph tools written against
  stock's graph (torchao's pt2e, ONNX; bnswap applies it for them).

:func:`plan` says what :func:`convert` would do to each node. And a bnswap program reaches
core ATen on its own: once anything is converted, ``run_decompositions()`` with the
default table turns the consolidated ops into stock's core ATen ops
(:mod:`bnswap._compat`, "core ATen").
"""

from __future__ import annotations

import copy
import fnmatch
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

import torch
from torch.fx import GraphModule, Node

from bnswap import _compat
from bnswap._graph import (
    _BACKWARD,
    _EVAL_KEPT,
    CONSOLIDATED_TARGETS,
    STOCK_TARGETS,
    _forward_of,
    check_program,
    consolidated_target,
    runs_bnswap_op,
    to_consolidated_ops,
    validation_error,
)
from bnswap._graph import to_stock_ops as _to_stock_ops_in_place
from bnswap._node_kernels import kernel_after, kernel_before
from bnswap._rows import Rows
from bnswap._warn import UnmatchedPatternWarning, warn
from bnswap.kernels import check_device

if TYPE_CHECKING:  # (typing.TypeIs is Python 3.13's)
    from typing_extensions import TypeIs

__all__ = [
    "NodeRow",
    "ProgramPlan",
    "check_device",
    "convert",
    "install_patches_for",
    "is_program",
    "plan",
    "plan_nodes",
    "to_stock_ops",
]

Program = torch.export.ExportedProgram | GraphModule


def is_program(obj: object) -> TypeIs[torch.export.ExportedProgram]:
    """True for a ``torch.export.ExportedProgram`` (what :func:`convert` / :func:`plan`
    take in place of a module)."""
    return isinstance(obj, torch.export.ExportedProgram)


def _graph_module(program: object, fn: str) -> GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        gm: GraphModule = program.graph_module
        return gm
    if isinstance(program, GraphModule):
        return program
    raise TypeError(
        f"bnswap.programs.{fn}() expects a torch.export.ExportedProgram or a "
        f"torch.fx.GraphModule, got {type(program).__name__}"
    )


def _check_backend(backend: str) -> None:
    if backend != "aten":
        raise ValueError(
            f"bnswap: backend={backend!r} takes an nn.Module; a program "
            "converts to the aten backend's ops only (backend='aten')"
        )


def _names(include: object, exclude: object) -> tuple[list[str], list[str]]:
    out: list[list[str]] = []
    for arg, p in (("include", include), ("exclude", exclude)):
        try:
            # (bytes: one pattern, refused below, not the ints list() makes of them)
            items = [] if p is None else [p] if isinstance(p, (str, bytes, bytearray)) else list(p)  # type: ignore[call-overload]  # not iterable: below
        except TypeError:  # (exclude=42: bnswap's message, not list()'s)
            items = [p]
        names = [item for item in items if isinstance(item, str)]
        if len(names) < len(items):
            bad = next(item for item in items if not isinstance(item, str))
            raise TypeError(
                f"{arg} takes glob patterns (str) on node names for a program, got {bad!r}"
            )
        out.append(names)
    return out[0], out[1]


def _selected(name: str, inc: list[str] | None, exc: list[str]) -> str | None:
    """Why node ``name`` is left out by the patterns (None: it is not; ``inc`` None: no
    include given, an empty list: ``include=[]``, which includes nothing)."""
    hit = next((p for p in exc if fnmatch.fnmatchcase(name, p)), None)
    if hit is not None:
        return f"excluded by {hit!r}"
    if inc is not None and not any(fnmatch.fnmatchcase(name, p) for p in inc):
        return "not matched by include"
    return None


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class NodeRow:
    """What :func:`convert` does to one batch-norm node of a program.

    Attributes:
        name: the node's name (``node.name``).
        op: its op now, e.g. ``"aten.batch_norm.default"``.
        action: ``"swap"``, ``"keep"`` (it runs a consolidated op already:
            :func:`convert` leaves it as it is) or ``"skip"``.
        becomes: the consolidated op it becomes (``"-"`` when skipped).
        reason: why it is skipped (``"-"`` when swapped).
        kernel_before: the kernel the node runs now on :attr:`device`, by torch's rule
            (:func:`bnswap.kernels.op_kernel`): stock's ``aten.batch_norm`` selects at
            run time whatever its ``cudnn_enabled`` says (cuDNN on CUDA where the rule
            holds; ``torch.export`` records ``cudnn_enabled=False``, which torch
            ignores); the ``_native_batch_norm_legit*`` / ``native_batch_norm`` ops bind
            the native kernel; ``_batch_norm_no_update`` (programs bnswap wrote before)
            has a kernel on the CPU only (``"CPU only (no CUDA kernel)"``).
        already: the node runs a consolidated op already (a bnswap program, or one
            converted before); :func:`convert` leaves it as it is.
        excluded: skipped because ``include`` / ``exclude`` left it out (or its forward
            node, for a backward node): the user's choice, not a node bnswap cannot
            rewrite.
        device: where :attr:`kernel` is evaluated (None: the node's input's device).

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> ep = torch.export.export(nn.Sequential(nn.BatchNorm1d(4)), (torch.randn(2, 4),))
        >>> row = bnswap.plan(ep)[0]
        >>> row.name, row.op, row.becomes, row.kernel
        ('batch_norm', 'aten.batch_norm.default', 'aten._batch_norm_with_update.default', 'Native')
    """

    name: str
    op: str
    action: str
    becomes: str
    reason: str
    kernel_before: str = "Native"
    already: bool = False
    excluded: bool = False
    node: Node | None = field(default=None, repr=False, compare=False)
    device: torch.device | None = field(default=None, repr=False, compare=False)

    @property
    def kernel(self) -> str:
        """The kernel the node runs on :attr:`device` once :func:`convert` has made it
        :attr:`becomes` (:func:`bnswap.kernels.op_kernel`: ``"Native"`` on CPU; on NVIDIA
        GPUs ``"Cudnn"`` where torch's rule holds for its arguments with convert's
        stand-ins); :attr:`kernel_before` for a node left as it is; ``"-"`` when
        skipped."""
        if self.action == "skip" or self.node is None:
            return "-"
        if self.action == "keep" or self.becomes == self.op:
            return self.kernel_before
        return kernel_after(self.node, _op_named(self.becomes), self.device)

    def to_dict(self) -> dict[str, str]:
        """The row as plain strings (for logging or JSON)."""
        return {
            "node": self.name,
            "op": self.op,
            "action": self.action,
            "becomes": self.becomes,
            "kernel_before": self.kernel_before,
            "kernel": self.kernel,
            "reason": self.reason,
        }


class ProgramPlan(Rows[NodeRow]):
    """The rows of a program's conversion, in graph order: what :func:`plan` returns
    for a program (``bnswap.plan(ep)``), as :class:`bnswap.Plan` is for a module.

    ``str(plan)`` is an aligned text table, ``plan.swapped`` / ``plan.skipped`` the rows by
    action, ``plan.to_dicts()`` plain dicts, :meth:`apply` the converted program.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> ep = torch.export.export(nn.Sequential(nn.BatchNorm1d(4)), (torch.randn(2, 4),))
        >>> bnswap.plan(ep)
        ProgramPlan(1 swap, 0 skip)
    """

    backend = "aten"

    def __init__(
        self,
        rows: Sequence[NodeRow],
        program: Program | None = None,
        include: object = None,
        exclude: object = None,
    ):
        self.rows: tuple[NodeRow, ...] = tuple(rows)
        self.program = program
        self._patterns = (include, exclude)

    counted = "batch-norm nodes"
    kept_as = "already on bnswap's ops"

    def apply(self) -> Program:
        """:func:`convert` the program with the plan's patterns: a new ExportedProgram
        (a GraphModule is rewritten in place and returned). A pattern that matches no
        node does not warn again (:func:`plan` did). Sets ``applied`` when it
        succeeds (:meth:`summary` then says "swapped", not "would be swapped")."""
        if self.program is None:
            raise ValueError(
                "this ProgramPlan has no program to apply to (build it with bnswap.plan)"
            )
        # planned again (the program may have changed), without the warnings plan gave
        new = _apply(
            plan_nodes(self.program, include=self._patterns[0], exclude=self._patterns[1])[0]
        )
        self.applied = True  # the summary says what was done from now on
        return new

    def __str__(self) -> str:
        header = ("node", "op", "action", "becomes", "kernel", "reason")
        if not self.rows:
            return self.summary() + " (the program has no batch-norm node)"
        body = [
            (
                r.name,
                r.op,
                r.action,
                r.becomes,
                r.kernel
                if r.kernel in (r.kernel_before, "-")
                else f"{r.kernel_before} -> {r.kernel}",
                r.reason,
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header) - 1)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                [*(c.ljust(w) for c, w in zip(cells, widths, strict=False)), cells[-1]]
            )

        rule = line(["-" * w for w in widths] + ["-" * len(header[-1])])
        return "\n".join([self.summary(), line(header), rule, *(line(b) for b in body)])

    def __repr__(self) -> str:
        return f"ProgramPlan({self._counts()})"


def _op_named(name: str) -> object:
    """The OpOverload ``str(op)`` names (``"aten._batch_norm_with_update.default"``)."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def plan(
    program: Program,
    backend: str = "aten",
    *,
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    device: torch.device | str | None = None,
) -> ProgramPlan:
    """What :func:`convert` would do to each batch-norm node of ``program``, without
    changing it (``bnswap.plan(program)`` comes here).

    Args:
        program: a ``torch.export.ExportedProgram`` or a ``torch.fx.GraphModule``.
        backend: ``"aten"`` only (ONNX Runtime runs modules, not programs).
        include, exclude: glob pattern(s) on node names (``node.name``); an empty
            ``include`` (``[]``) includes no node (a warning says so), None every node.
        device: where to evaluate the kernel column; default: the device of each node's
            input (``node.meta["val"]``). An absent CUDA device is predicted by torch's
            rule (``"Cudnn (predicted)"``).

    Returns:
        A :class:`ProgramPlan`: one :class:`NodeRow` per batch-norm node, stock's
        (:data:`bnswap._graph.STOCK_TARGETS`) or consolidated already (``already``).

    Raises:
        TypeError: ``program`` is neither; a pattern is not a str.
        ValueError: ``backend`` is not ``"aten"``.
        RuntimeError: ``device`` is not a device torch knows.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
        >>> print(bnswap.plan(ep, device="cuda").summary())
        bnswap plan: 1 of 1 batch-norm nodes would be swapped, 0 skipped
    """
    install_patches_for(program)  # a program on bnswap's ops: torchao's flow needs the patches
    todo, unmatched = plan_nodes(program, backend, include=include, exclude=exclude, device=device)
    for kind, p in unmatched:  # as plan() does for layers
        warn(
            "bnswap: include is empty, so it matches no batch-norm node and none is swapped "
            "(include=None, the default, swaps every node)"
            if p is None
            else f"bnswap: {kind} pattern {p!r} matches no batch-norm node (program patterns "
            "match node names, e.g. 'batch_norm_1')",
            UnmatchedPatternWarning,
        )
    return todo


def plan_nodes(
    program: Program,
    backend: str = "aten",
    *,
    include: object = None,
    exclude: object = None,
    device: torch.device | str | None = None,
) -> tuple[ProgramPlan, list[tuple[str, str | None]]]:
    """:func:`plan`, warning nothing: the plan, and each include / exclude pattern that
    matches no batch-norm node as ``("include" | "exclude", pattern)``, which :func:`plan`
    warns about (and :meth:`ProgramPlan.apply`, planning again, does not)."""
    gm = _graph_module(program, "plan")
    _check_backend(backend)
    if is_program(program):
        check_program(program, repair=False)  # torch's error for a program not valid
    dev = check_device(device)
    inc, exc = _names(include, exclude)
    rows = []
    for sub in gm.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for n in graph.nodes:
            if runs_bnswap_op(n):
                rows.append(
                    NodeRow(
                        n.name,
                        str(n.target),
                        "keep",
                        str(n.target),
                        "already the consolidated op"
                        if n.target in CONSOLIDATED_TARGETS
                        else _EVAL_KEPT,
                        kernel_before(n, dev),
                        already=True,
                        node=n,
                        device=dev,
                    )
                )
                continue
            if n.op != "call_function" or n.target not in STOCK_TARGETS:
                continue
            target, reason = consolidated_target(n)
            left_out = _selected(n.name, None if include is None else inc, exc)
            excluded = left_out is not None
            if left_out is not None:
                target, reason = None, left_out
            elif target is not None and n.target is _BACKWARD:
                # the rewrite needs the forward's reserve: it happens only when the
                # forward node (its row is above: graph order) is rewritten too
                fwd = _forward_of(n)
                fwd_row = next((r for r in rows if r.node is fwd), None)
                if fwd_row is not None and fwd_row.action == "skip":
                    target, reason = (
                        None,
                        (f"its forward node {fwd_row.name!r} is left as it is ({fwd_row.reason})"),
                    )
                    excluded = fwd_row.excluded
            rows.append(
                NodeRow(
                    n.name,
                    str(n.target),
                    "swap" if target else "skip",
                    str(target) if target else "-",
                    reason,
                    kernel_before(n, dev),
                    excluded=excluded and not target,
                    node=n,
                    device=dev,
                )
            )
    unmatched: list[tuple[str, str | None]] = [
        (kind, p)
        for kind, pats in (("include", inc), ("exclude", exc))
        for p in pats
        if not any(fnmatch.fnmatchcase(r.name, p) for r in rows)
    ]
    if include is not None and not inc:
        unmatched.append(("include", None))  # include=[]: nothing is included
    return ProgramPlan(rows, program, include, exclude), unmatched


# -------------------------------------------------------------------------- convert
def convert(
    program: Program,
    backend: str = "aten",
    *,
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
) -> Program:
    """Make every stock batch-norm node of ``program`` run the ops a swapped layer runs
    (``bnswap.convert(program)`` comes here).

    The rules (the ops' schemas, ``native_functions.yaml``; the consolidated ops take
    the same arguments and update the statistics with the same momentum and unbiased
    batch variance, so outputs and statistics are bitwise stock's on CPU):

    * ``aten.batch_norm`` (``torch.export``'s training IR, any ``cudnn_enabled``),
      ``native_batch_norm``, ``_native_batch_norm_legit`` in training ->
      ``_batch_norm_with_update`` (updates its statistics in place, as they did);
    * ``_native_batch_norm_legit_functional`` (``run_decompositions()``) ->
      ``_batch_norm_with_update_functional``: its new running_mean / running_var outputs
      are the same ``getitem`` nodes, so the signature's ``buffers_to_mutate`` stay;
    * evaluation: ``aten.batch_norm`` stays (it picks cuDNN / MIOpen / native when it
      runs: what a swapped layer runs in evaluation); ``_native_batch_norm_legit_no_training``,
      ``native_batch_norm`` / ``_native_batch_norm_legit`` with ``training=False`` (they
      bind the native kernel) and the ``_batch_norm_no_update`` of programs earlier bnswap
      releases wrote (it has no kernel off the CPU) -> ``aten.batch_norm(...,
      training=False, ...)``, when only their output 0 is used;
    * no running statistics (``track_running_stats=False``,
      ``_native_batch_norm_legit.no_stats``) -> ``_batch_norm_with_update_functional`` on
      throw-away statistics; a missing weight / bias (``affine=False``) -> stand-in ones /
      zeros (cuDNN is chosen only when both are defined; ``batch_norm_backward`` needs a
      weight): ``aten.full_like`` of the node's first (C,) tensor or of a (C,) view of its
      input (``aten.select``), exactly what bnswap's own layers record, so the program
      carries no device or dtype of its own and moves as the original does, and
      :func:`bnswap.to_stock_ops` turns them back;
    * ``native_batch_norm_backward`` (joint / backward graphs) -> ``batch_norm_backward``
      with its forward's reserve (output 3);
    * an input whose size is dynamic (``Dim("batch")`` admits 0) gets bnswap's empty-batch
      assertion (:data:`bnswap.functional.EMPTY_BATCH_MESSAGE`, a RuntimeError), right
      after the input is computed, so before the node's ``num_batches_tracked`` /
      statistics updates: the consolidated ops reject an empty batch, where stock's
      ``aten.batch_norm`` returns early. :func:`bnswap.to_stock_ops` removes it again.

    A node is left as it is (:func:`plan` says why) when its training flag or momentum is
    not a constant, an evaluation node's save_mean / save_invstd are used (a backward
    graph), or it has neither a weight, a bias nor statistics and its input no shape
    metadata (the rank of the view its stand-ins are made like).

    Args:
        program: a ``torch.export.ExportedProgram`` (not changed: a new program is
            returned, its own copy of the state) or a ``torch.fx.GraphModule``
            (``ep.module()``, a ``make_fx`` / AOT graph: rewritten in place).
        backend: ``"aten"`` only (ONNX Runtime runs modules, not programs).
        include, exclude: glob pattern(s) on node names (an empty ``include`` includes
            none, as for a module).

    Returns:
        The new ``ExportedProgram`` (``torch.export.save`` / ``load`` round-trip it,
        ``.module()`` runs it on any device, ``run_decompositions({})`` keeps the
        consolidated ops of training; ``aten.batch_norm`` decomposes there, as stock's), or
        the ``GraphModule`` itself. A program with no stock batch-norm node (none at all,
        or only consolidated ones: converted already, e.g. a ``.pt2`` that ``bnswap
        convert`` wrote, loaded) is returned itself. A program holding consolidated nodes
        applies bnswap's patches (``docs/patches.md``), as a first swap does, even when
        nothing in it changes: torchao's pt2e flow (``docs/qat.md``) and
        ``run_decompositions()`` then treat it as stock's. So does :func:`plan` of it.

    Raises:
        TypeError: ``program`` is neither; a pattern is not a str.
        ValueError: ``backend`` is not ``"aten"``.
        torch._export.verifier.SpecViolationError: ``program`` is not a valid
            ``ExportedProgram`` (``program.validate()``'s error), raised before anything
            changes. A program whose graph signature spells a placeholder or output
            otherwise only because torch renamed the node (``copy.deepcopy(ep)`` of an
            ``nn.Sequential`` program names its input ``input_1``) is taken: the result
            has the signature's names and is valid.

    Warns:
        UserWarning: the program has no batch-norm node, or none can be converted.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
        >>> new = bnswap.convert(ep)
        >>> [str(n.target) for n in new.graph.nodes if "batch_norm" in str(n.target)]
        ['aten._batch_norm_with_update.default']
        >>> new is not ep
        True
    """
    _graph_module(program, "convert")
    _check_backend(backend)
    return _apply(plan(program, include=include, exclude=exclude))  # (plan: the patches)


def _apply(todo: ProgramPlan) -> Program:
    """What :func:`convert` does once it has planned: ``todo.program`` with the nodes
    ``todo`` swaps rewritten (warning about a program with nothing to convert, not about
    the patterns: planning did)."""
    program = todo.program
    assert program is not None
    gm = _graph_module(program, "convert")
    include, exclude = todo._patterns
    kind = "program" if is_program(program) else "graph"
    if not todo.rows:
        if is_program(program):
            warn(
                "bnswap.convert: the program has no batch-norm node; it is returned unchanged",
                UserWarning,
            )
        return _valid(program)
    if todo.swapped and all(r.already for r in todo.swapped):
        return _valid(program)  # converted already (idempotent, as for a module)
    if not todo.swapped:
        if include is None and exclude is None:
            warn(
                f"bnswap.convert: none of the {kind}'s {len(todo)} batch-norm nodes can be "
                "converted; see bnswap.plan(program) for why",
                UserWarning,
            )
        return program
    _compat.install()  # (as a first swap does) run_decompositions() reaches core ATen
    names = {r.name for r in todo.swapped if not r.already}
    if isinstance(program, torch.export.ExportedProgram):
        new = _copy(program)
        to_consolidated_ops(
            new.graph_module, names=names.__contains__, renamed=new.graph_signature.replace_all_uses
        )
        error = validation_error(new)
        if error is not None:
            raise error
        return new
    to_consolidated_ops(gm, names=names.__contains__)
    return gm


@overload
def to_stock_ops(
    module: torch.export.ExportedProgram, *, core_aten: bool = False
) -> torch.export.ExportedProgram: ...
@overload
def to_stock_ops(module: GraphModule, *, core_aten: bool = False) -> GraphModule: ...
def to_stock_ops(module: Program, *, core_aten: bool = False) -> Program:
    """Make bnswap's batch-norm nodes of an exported graph stock's ``aten.batch_norm``
    again: the inverse of :func:`convert`, with its convention (issue 46).

    The rewritten graph is the one stock ``nn.BatchNorm`` layers record: the same op,
    arguments, outputs and statistics updates (the rule is ``bnswap._graph``'s, from the
    ops' schemas in ``native_functions.yaml``; bnswap's empty-batch assertions go with
    them). bnswap runs it for torchao's ``prepare_pt2e`` / ``prepare_qat_pt2e``; call it
    yourself for other graph tools written against stock's op. The kernel is then
    stock's (:mod:`bnswap.kernels`): ``aten.batch_norm`` selects when it runs, cuDNN on
    CUDA where torch's rule holds, as the consolidated op did, except for a layer
    without affine parameters in training (its stand-ins go: native, as stock's); with
    ``core_aten=True`` the ``_native_batch_norm_legit*`` ops bind the native kernel.

    Args:
        module: a ``torch.export.ExportedProgram``: not changed, a new program is returned
            (its own copy of the state), as :func:`convert` and torch's own passes
            (``run_decompositions``) return one; or a ``torch.fx.GraphModule``
            (``exported_program.module()``, a ``torch.export`` / ``make_fx`` graph, a pt2e
            prepared graph): rewritten in place and returned, as :func:`convert` and
            :func:`bnswap.revert` do with a module. Its nodes are
            ``aten._batch_norm_with_update`` / ``_batch_norm_no_update`` (the graph
            ``torch.export.export`` returns) or, after ``run_decompositions()``,
            ``_batch_norm_with_update_functional``.
        core_aten: the graph is core ATen (``run_decompositions()`` was run): the nodes
            become stock's decomposed ops, ``_native_batch_norm_legit_functional`` /
            ``_native_batch_norm_legit.no_stats`` (track_running_stats=False) /
            ``_native_batch_norm_legit_no_training``, not ``aten.batch_norm``.

    Returns:
        The new program, or the graph module itself. A program with no node of bnswap's
        is returned itself. How many nodes there are: ``bnswap.plan(module)``.

    Raises:
        TypeError: ``module`` is neither.
        torch._export.verifier.SpecViolationError: ``module`` is not a valid program
            (``validate()``'s error), before anything changes (:func:`convert` takes a deep
            copy's renamed placeholder the same way).

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        >>> ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
        >>> stock = bnswap.to_stock_ops(ep)
        >>> stock is not ep, [str(n.target) for n in stock.graph.nodes if "norm" in n.name]
        (True, ['aten.batch_norm.default'])
        >>> gm = ep.module()
        >>> bnswap.to_stock_ops(gm) is gm
        True
    """
    if not is_program(module):
        _to_stock_ops_in_place(module, core_aten=core_aten)  # (its TypeError for others)
        return module
    gm = module.graph_module
    if not any(
        n.op == "call_function" and n.target in CONSOLIDATED_TARGETS
        for sub in gm.modules()
        for n in getattr(sub, "graph", torch.fx.Graph()).nodes
    ):
        return _valid(module)
    new = _copy(module)
    _to_stock_ops_in_place(new, core_aten=core_aten)
    return new


def _valid(program: Program) -> Program:
    """``program`` itself when it is valid (or a GraphModule), else its mended copy
    (:func:`_copy`: a deep copy's renamed placeholder)."""
    if isinstance(program, torch.export.ExportedProgram) and validation_error(program):
        return _copy(program)
    return program


def _copy(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A deep copy of ``ep`` (graph, state, signature) with its node names kept, and
    valid (:func:`bnswap._graph.check_program`: a program whose signature spells a
    placeholder or output otherwise, because a deep copy of it renamed one, is mended; any
    other invalid program raises torch's error here, before anything is rewritten).
    ``copy.deepcopy`` renames a node that shadows a Python builtin (``input`` becomes
    ``input_1``). torch's own deep copy of a program warns about torch's pytree API
    (torch 2.13: a FutureWarning from ``copyreg``), which the user cannot act on: not
    shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        new = copy.deepcopy(ep)
    renamed = False
    for old, n in zip(ep.graph.nodes, new.graph.nodes, strict=True):
        if n.name != old.name:
            n.name = old.name  # (torch.export names its placeholders the same way)
            if n.op == "placeholder":
                n.target = old.target
            renamed = True
    if renamed:
        new.graph_module.recompile()
    check_program(new, repair=True)
    return new


def stock_nodes(gm: GraphModule, consolidated: bool = False) -> int:
    """How many stock batch-norm nodes ``gm`` holds (its own graph and nested ones);
    with ``consolidated``, the consolidated ones too (every node :func:`plan` lists)."""
    targets = (*STOCK_TARGETS, *CONSOLIDATED_TARGETS) if consolidated else STOCK_TARGETS
    return _count(gm, targets)


def _count(gm: GraphModule, targets: Iterable[object]) -> int:
    targets = frozenset(targets)
    return sum(
        1
        for sub in gm.modules()
        for n in getattr(sub, "graph", torch.fx.Graph()).nodes
        if n.op == "call_function" and n.target in targets
    )


def install_patches_for(program: Program) -> None:
    """bnswap's patches (:func:`bnswap._compat.install`) when ``program`` (nested graphs
    included) holds a node on a consolidated batch-norm op
    (:data:`bnswap._graph.CONSOLIDATED_TARGETS`). Every entry point that takes a program
    calls it (``bnswap.convert`` / ``plan`` / ``revert`` of an ``ExportedProgram`` or a
    ``GraphModule``): a program that ``bnswap convert`` wrote, loaded with
    ``torch.export.load``, swaps no layer when it loads, yet torchao's pt2e flow needs the
    patches for it (:func:`bnswap._compat.torchao.patch_torchao_pt2e`); ``bnswap.convert``
    of it changes nothing in the graph and applies them. A no-op once installed, and for
    a program on stock's ops only.

    Examples::

        >>> import torch, bnswap
        >>> from bnswap import _compat
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> ep = bnswap.convert(torch.export.export(model, (torch.randn(2, 3, 8, 8),)))
        >>> bnswap.programs.install_patches_for(ep)  # it holds _batch_norm_with_update
        >>> len(_compat.applied()) > 0  # the patches' targets, applied
        True
    """
    if _compat.installed():
        return
    gm = program.graph_module if is_program(program) else program
    if isinstance(gm, GraphModule) and _count(gm, CONSOLIDATED_TARGETS):
        _compat.install()
