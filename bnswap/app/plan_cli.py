"""``bnswap plan``: what bnswap would swap in a model, before training.

    bnswap plan --model torchvision.models.resnet18 [--model.num_classes 10]
    bnswap plan --model.class_path torchvision.models.ResNet --model.init_args.layers ...
    bnswap plan --config configs/digits_mobilenetv2.yaml        # the main job's model
    bnswap plan --program model.pt2                             # a torch.export program
    bnswap plan ... [--backend aten|ort] [--include P | '[P, ...]'] [--exclude P | '[P, ...]']
                    [--device cuda] [--format table|json|markdown]

The model is any importable ``nn.Module`` class or function that returns one (from the
current folder too, as ``python -m`` finds modules), with its arguments given the
jsonargparse way (``--model.NAME VALUE``); a function with no return annotation is
called and its result checked to be an ``nn.Module`` (each of its parameters with no
default and no annotation must be given: a usage error names it). A class's required
parameter needs a type annotation (jsonargparse's rule; the error says so). ``--config``
builds the model of a ``bnswap train`` config (a path, or the name of a config shipped
with bnswap) and takes the backend and patterns of its ``BNSwap`` callback unless given
here. Nothing is trained, no data is loaded, no Trainer is built.

``--program`` plans a ``torch.export.save`` file node by node (what ``bnswap convert
model.pt2 -o model_bnswap.pt2`` does to it: :mod:`bnswap.app.convert_cli`). What both
commands print and return is :mod:`bnswap.app.plan_output`'s.

``--sync_batchnorm`` plans ``bnswap.plan(..., sync_batchnorm=True)``: every
``BatchNorm1d/2d/3d`` becomes a synchronized ``SyncBatchNorm`` (the table's ``sync``
column); with ``--config``, the config's ``trainer.sync_batchnorm`` unless given here.

Exit status: 0 when every BatchNorm layer (or batch-norm node) would be swapped or was
left out on purpose (``--include`` / ``--exclude``, or the config's callback's patterns),
3 when bnswap would skip one it cannot swap or the backend would refuse the model
(``--backend ort`` with an uninitialized lazy layer, or with any layer left stock; so CI
can gate on it), 2 on usage errors.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
import warnings
from argparse import Action, ArgumentError
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Literal, get_type_hints

import torch
import yaml
from jsonargparse import ArgumentParser, DefaultHelpFormatter
from torch import nn

import bnswap
from bnswap.app.configs import resolve as resolve_config
from bnswap.app.convert_cli import (
    NO_SYNC_FOR_PROGRAMS,
    ProgramFileError,
    convert_main,  # (its old place, kept: `bnswap convert` is bnswap.app.convert_cli's)
    load_program,
)
from bnswap.app.messages import (
    did_you_mean,
    import_path,
    long_options,
    pattern_error,
    short_error,
    unrecognized_error,
)
from bnswap.app.plan_output import (
    EXIT_ALL_SWAPPED,
    EXIT_SOME_SKIPPED,
    EXIT_USAGE,
    WARNING_PREFIX,
    exit_status,
    print_warnings,
    render,
    usage_error,
)
from bnswap.extras import install_hint

__all__ = ["EXIT_ALL_SWAPPED", "EXIT_SOME_SKIPPED", "EXIT_USAGE", "convert_main", "main", "render"]

Format = Literal["table", "json", "markdown"]


class _HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help without the "known subclasses" list of ``--model``: for
    ``nn.Module`` it names every module class imported (hundreds of lines)."""

    def _get_help_string(self, action: Action) -> str:
        text = super()._get_help_string(action)
        cut = text.find(", known subclasses: ")
        return text if cut < 0 else text[:cut] + ")"


def _parser(factory: Any = None) -> ArgumentParser:
    """The options; with ``factory`` (an unannotated model function), ``--model`` is its
    dotted path and its arguments are ``--model_args.NAME`` (see :func:`main`)."""
    p = ArgumentParser(
        prog="bnswap plan",
        exit_on_error=False,
        formatter_class=_HelpFormatter,
        description="Show what bnswap would swap in a model (no training, no data). Exit "
        "status 0: every BatchNorm layer swapped or excluded on purpose "
        "(--include / --exclude); 3: some skipped that bnswap cannot swap, or "
        "the backend would refuse the model; 2: usage error.",
    )
    if factory is not None:
        p.add_argument("--model", type=str)
        p.add_function_arguments(factory, "model_args", fail_untyped=False)
    else:
        p.add_argument(
            "--model",
            type=nn.Module | None,
            default=None,
            help="the model: an importable nn.Module class, or function that "
            "returns one (e.g. torchvision.models.resnet18, or "
            "mymodels.Net from the current folder), its arguments as "
            "--model.NAME VALUE or --model.init_args.NAME VALUE",
        )
    p.add_argument(
        "--config",
        type=str | None,
        default=None,
        help="a `bnswap train` config (path, or the name of a config shipped "
        "with bnswap, e.g. digits_mobilenetv2.yaml): plan its model",
    )
    p.add_argument(
        "--program",
        type=str | None,
        default=None,
        help="a torch.export program file (torch.export.save, .pt2): one row per "
        "batch-norm node, what `bnswap convert` does to it",
    )
    p.add_argument(
        "--backend",
        type=Literal["aten", "ort"] | None,
        default=None,
        help="aten (PyTorch's consolidated ops) or ort (ONNX Runtime); default: "
        "the config's BNSwap callback, else aten",
    )
    p.add_argument(
        "--include",
        type=str | list[str] | None,
        default=None,
        help="a glob pattern on qualified layer names to swap, or a list of "
        "them (--include 'backbone.*', --include '[\"a.*\", \"b\"]'); "
        "default: all",
    )
    p.add_argument(
        "--exclude",
        type=str | list[str] | None,
        default=None,
        help="a glob pattern on qualified layer names to leave stock, or a "
        "list of them (--exclude 'head.*', or --exclude+ P once per "
        "pattern)",
    )
    p.add_argument(
        "--device",
        type=str | None,
        default=None,
        help="the device for the kernel column (e.g. cuda); one that is not "
        "present here is predicted from torch's rule, and the output says so",
    )
    p.add_argument(
        "--sync_batchnorm",
        type=bool,
        nargs="?",
        const=True,
        default=None,
        help="plan bnswap.plan(..., sync_batchnorm=True): every BatchNorm1d/2d/3d "
        "becomes a synchronized SyncBatchNorm (the sync column); "
        "--sync_batchnorm alone is true; default: the config's "
        "trainer.sync_batchnorm, else false",
    )
    p.add_argument(
        "--format",
        type=Format,
        default="table",
        help="table (aligned text), json (one object per layer and a summary), "
        "markdown (for pull requests)",
    )
    return p


def _model_path(argv: Sequence[str]) -> str | None:
    """The value of ``--model`` when it is given as a dotted path (not a dict)."""
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def _plain_factory(argv: Sequence[str]) -> Any:
    """``--model`` naming a function with no return annotation (``def net(): return
    nn.Sequential(...)``): jsonargparse accepts only classes or functions annotated to
    return a module, so such a factory gets its arguments from its signature here, is
    called, and its result is checked to be an ``nn.Module``."""
    path = _model_path(argv)
    if not path or path.lstrip().startswith("{"):
        return None
    fn = import_path(path)
    if fn is None or inspect.isclass(fn) or not callable(fn):
        return None
    try:
        ret = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return None
    return fn if ret is inspect.Signature.empty else None


def _factory_help(parser: Any, path: str) -> str:
    """``--help`` with ``--model`` naming a plain factory: jsonargparse's help with the
    factory's arguments spelled as they are given, ``--model.NAME`` (the parser holds
    them as ``--model_args.NAME``), under a title naming the factory, not its repr."""
    text = re.sub(r"\[--model_args CONFIG\]\s*", "", parser.format_help())
    text = re.sub(r"\n  --model_args CONFIG +[^\n]*", "", text)
    text = re.sub(
        r"^<function [^\n]*>:$",
        f"arguments of {path} (--model.NAME VALUE):",
        text,
        flags=re.MULTILINE,
    )
    return text.replace("--model_args.", "--model.").rstrip("\n")


def _missing_factory_args(fn: Any, argv: Sequence[str], cfg: Any) -> str | None:
    """The usage error for a plain factory's required parameters with no annotation that
    ``argv`` does not give (``def f(width): ...`` without ``--model.width``), or None.
    jsonargparse (``fail_untyped=False``) makes such a parameter optional with default
    None, which the function would then be called with."""
    given = getattr(cfg, "model_args", None)
    missing = []
    for p in inspect.signature(fn).parameters.values():
        if (
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            or p.default is not p.empty
            or p.annotation is not p.empty
        ):
            continue  # (jsonargparse itself requires an annotated one)
        named = any(
            a == f"--model_args.{p.name}" or a.startswith(f"--model_args.{p.name}=") for a in argv
        )
        if not named and getattr(given, p.name, None) is None:
            missing.append(p.name)
    if not missing:
        return None
    one = len(missing) == 1
    return (
        f"model: {cfg.model} needs {' and '.join(missing)}, which "
        f"{'has' if one else 'have'} no default: give {'it' if one else 'them'} as "
        + " ".join(f"--model.{n} VALUE" for n in missing)
    )


class _FactoryError(ValueError):
    """A plain factory (``--model`` naming a function with no return annotation) raised
    while building the model: the message names the call and the values it got."""


def _build_factory(fn: Any, args: Any) -> nn.Module:
    """Call the plain factory ``fn`` with the parsed ``--model.NAME`` values.

    Raises:
        _FactoryError: (a ValueError) ``fn`` raised any Exception but an ImportError (a
            missing package: :func:`main` names it), as jsonargparse reports what a
            class raises while it is built (one line, exit 2, not a traceback).
        TypeError: ``fn`` returned no ``nn.Module``.
    """
    given = getattr(args, "model_args", None)  # absent when the function takes nothing
    kwargs = dict(vars(given)) if given is not None else {}
    try:
        model = fn(**kwargs)
    except ImportError:
        raise
    except Exception as e:  # say which call: its values may be unparsed
        call = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise _FactoryError(f"{args.model}({call}) raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"{args.model} returned {type(model).__name__}, not an nn.Module")
    return model


#: Most names listed for a ``--model`` that is a module (``torch.nn`` holds hundreds).
_MAX_LISTED = 6


def _returns_no_module(fn: Any) -> bool:
    """Whether ``fn``'s return annotation names a class that is no ``nn.Module`` (an
    unannotated or unresolvable one may return a module)."""
    try:
        ret = get_type_hints(fn).get("return")
    except Exception:  # a string annotation that does not resolve
        return False
    return inspect.isclass(ret) and not issubclass(ret, nn.Module)


def _models_in(module: ModuleType) -> list[str]:
    """The dotted paths of what ``module`` holds that ``--model`` takes: its public
    ``nn.Module`` classes and functions (its ``__all__``, else those defined in it or
    its submodules), a function annotated to return something else left out."""
    exported = getattr(module, "__all__", None)
    names = (
        list(exported)
        if exported is not None
        else [n for n in vars(module) if not n.startswith("_")]
    )
    found = []
    for name in names:
        obj = getattr(module, name, None)
        home = getattr(obj, "__module__", None) or ""
        if (
            exported is None
            and home != module.__name__
            and not home.startswith(module.__name__ + ".")
        ):
            continue  # imported into it (from torch import nn: nn.Module)
        if (inspect.isclass(obj) and issubclass(obj, nn.Module)) or (
            inspect.isfunction(obj) and not _returns_no_module(obj)
        ):
            found.append(f"{module.__name__}.{name}")
    return found


def _module_error(argv: Sequence[str]) -> str | None:
    """The usage error for ``--model`` naming a module (``--model mymodels``), which
    jsonargparse reports as "expected Module or None": it is a module, and the classes
    and functions in it that ``--model`` takes. None when ``--model`` names no module."""
    path = _model_path(argv)
    if not path or path.lstrip().startswith("{"):
        return None
    try:
        module = importlib.import_module(path)
    except Exception:  # not a module (mymodels.Net), or it fails to
        return None  # import: jsonargparse reports it as for any path
    found = _models_in(module)
    if not found:
        return (
            f"model: {path} is a module, not a model, and holds no nn.Module class or "
            "function; give a class, or a function that returns a module: --model "
            f"{path}.NAME"
        )
    more = f", ... ({len(found)} in all)" if len(found) > _MAX_LISTED else ""
    return (
        f"model: {path} is a module, not a model; give a class or function in it: "
        f"{', '.join(found[:_MAX_LISTED])}{more}"
    )


#: Device types named in the error for one torch does not know (torch lists 20).
_DEVICE_EXAMPLES = "cpu, cuda, cuda:1, mps, xpu, meta"


def _device_error(device: str) -> str | None:
    """The usage error for a ``--device`` torch does not read (``tpu``, ``cuda:x``), in
    one line (torch's names all 20 device types), or None."""
    try:
        torch.device(device)
    except RuntimeError as e:
        if str(e).startswith("Expected one of"):
            return (
                f"device: {device.partition(':')[0]!r} is not a device type torch knows "
                f"(e.g. {_DEVICE_EXAMPLES})"
            )
        return f"device: {device!r}: {short_error(str(e))} (e.g. {_DEVICE_EXAMPLES})"
    return None


def _instantiate(parser: Any, cfg: Any) -> Any:
    """``parser.instantiate(cfg)`` (jsonargparse >= 4.49, where ``instantiate_classes`` is
    deprecated), or ``instantiate_classes`` on older releases."""
    return getattr(parser, "instantiate", parser.instantiate_classes)(cfg)


def _from_config(path: str) -> tuple[nn.Module, dict[str, Any] | None, bool]:
    """The model of a ``bnswap train`` config, its BNSwap callback's arguments (None
    when the config has no BNSwap callback: training it swaps nothing), and its
    ``trainer.sync_batchnorm`` (with BNSwap, training synchronizes every layer)."""
    with open(resolve_config(path)) as f:
        try:
            cfg = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise ValueError(f"{path}: no 'model' section (is it a `bnswap train` config?)")
    class_path = cfg["model"].get("class_path") if isinstance(cfg["model"], dict) else None
    if isinstance(class_path, str) and "." in class_path:  # a missing package said plainly
        importlib.import_module(class_path.rsplit(".", 1)[0])
    parser = _parser()
    built = _instantiate(parser, parser.parse_object({"model": cfg["model"]}))
    model = built.model
    configure = getattr(model, "configure_model", None)
    if callable(configure):  # a LightningModule that builds its layers there
        configure()
    swap: dict[str, Any] | None = None
    trainer = cfg.get("trainer") or {}
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("BNSwap"):
            swap = dict(cb.get("init_args") or {})
    return model, swap, trainer.get("sync_batchnorm") is True


_UNTYPED = re.compile(r"parameter '(?P<name>[^']+)' of (?P<src>[\w.]+) has no type annotation")


def _untyped_hint(text: str) -> str | None:
    """:func:`short_error`'s line for a ``--model`` whose required parameter has no
    annotation (a class's ``__init__(self, width)``), with what ``bnswap plan`` offers
    besides annotating it: a function with no return annotation is called as it is."""
    m = _UNTYPED.search(text)
    if m is None:
        return None
    name, src = m.group("name"), m.group("src")
    if inspect.isclass(import_path(src)):
        short = src.rsplit(".", 1)[-1]
        return (
            f"{text}, or wrap the class in a function with no return annotation "
            f"(def make({name}): return {short}({name})), which bnswap plan calls with "
            f"--model.{name} VALUE"
        )
    return (
        f"{text}, or drop the function's return annotation: bnswap plan then calls it "
        f"with --model.{name} VALUE as given"
    )


_NOT_ACCEPTED = re.compile(r"Option '(?P<name>[^']+)' is not accepted")


def _class_option_error(message: str, argv: Sequence[str]) -> str | None:
    """jsonargparse's "Option 'widht' is not accepted" for ``--model.widht`` where
    ``--model`` is a class (issue 46: a function's mistyped argument got a did-you-mean,
    a class's did not) as the function's line: ``unknown option '--model.widht'; did
    you mean '--model.width'?``, the closest of the class's constructor parameters, in
    the form given (``--model.init_args.widht`` too). None for any other message."""
    refused = _NOT_ACCEPTED.search(message)
    if refused is None:
        return None
    name = refused.group("name")
    given = next(
        (
            key
            for a in argv
            if (key := a.split("=", 1)[0]).startswith("--model.") and key.rsplit(".", 1)[-1] == name
        ),
        None,
    )
    cls = import_path(_model_path(argv) or "")
    if given is None or not inspect.isclass(cls):
        return None
    prefix = given[: len(given) - len(name)]
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    close = did_you_mean(name, names)  # (on the names alone: the prefix is common to all)
    return f"unknown option {given!r}" + close.replace("mean '", f"mean '{prefix}", 1)


@contextlib.contextmanager
def _prog(prog: str) -> Iterator[None]:
    """``sys.argv[0]`` as ``prog`` while parsing: jsonargparse's ``--model.help CLASS``
    builds a parser of its own, whose usage line names ``sys.argv[0]`` (``usage: bnswap
    [--model.width WIDTH]``, or ``_bnswap_command.py`` under ``python -m``)."""
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = prog
    else:
        sys.argv.append(prog)
    try:
        yield
    finally:
        if saved is None:
            sys.argv.clear()
        else:
            sys.argv[0] = saved


def main(argv: Sequence[str]) -> int:
    """Run ``bnswap plan`` with ``argv`` (the arguments after ``plan``); return the exit
    status (0 all swapped or left out on purpose, 3 some skipped that bnswap cannot swap,
    2 usage errors: printed to stderr; :func:`exit_status`)."""
    argv = list(argv)
    if "-h" not in argv and "--help" not in argv and (error := _module_error(argv)):
        return usage_error(error)
    factory = _plain_factory(argv)
    if factory is not None:  # its arguments: --model.NAME VALUE, as for a class
        argv = [
            a.replace("--model.", "--model_args.", 1) if a.startswith("--model.") else a
            for a in argv
        ]
    parser = _parser(factory)
    if factory is not None and ("-h" in argv or "--help" in argv):
        print(_factory_help(parser, _model_path(argv) or ""))
        return EXIT_ALL_SWAPPED
    try:
        with _prog("bnswap plan"):
            cfg = parser.parse_args(argv)
    except SystemExit as e:  # --help (0)
        return int(e.code or 0)
    except ArgumentError as e:
        hint = (
            "(give an nn.Module class, or a function that returns a module; see bnswap plan --help)"
            if "does not correspond to a subclass of Module" in str(e)
            else "(bnswap plan --help lists every option)"
        )
        text = (
            _class_option_error(str(e), argv)
            or unrecognized_error(str(e), long_options(parser))
            or short_error(str(e))
        )
        text = text.replace("model_args.", "model.")
        if (untyped := _untyped_hint(text)) is not None:  # the help would not help
            return usage_error(untyped)
        return usage_error(f"{text}\n{hint}")
    if (error := pattern_error(cfg)) is not None:
        return usage_error(f"{error}\n(bnswap plan --help lists every option)")
    if sum(v is not None for v in (cfg.model, cfg.config, cfg.program)) != 1:
        return usage_error(
            "give exactly one of --model, --config or --program (see bnswap plan --help)"
        )
    if factory is not None and (error := _missing_factory_args(factory, argv, cfg)):
        return usage_error(error)
    if cfg.program is not None and cfg.backend not in (None, "aten"):
        return usage_error(
            f"--backend {cfg.backend} runs modules; a program converts to "
            "the aten backend's ops only"
        )
    if cfg.program is not None and cfg.sync_batchnorm:
        return usage_error(NO_SYNC_FOR_PROGRAMS)
    if cfg.device is not None and (error := _device_error(cfg.device)):
        return usage_error(error)  # (before the model is built)
    synced = False
    model: nn.Module | torch.export.ExportedProgram
    swap: dict[str, Any] | None
    try:
        if cfg.program is not None:
            model, swap = load_program(cfg.program), {}
        elif cfg.config is not None:
            model, swap, synced = _from_config(cfg.config)
        elif factory is not None:
            model, swap = _build_factory(factory, cfg), {}
        else:
            model, swap = _instantiate(parser, cfg).model, {}
    except ProgramFileError as e:
        return usage_error(str(e))
    except ArgumentError as e:  # a config's model that jsonargparse refuses
        return usage_error(f"{cfg.config}: {short_error(str(e))}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("lightning", "pytorch_lightning", "sklearn"):
            return usage_error(
                f"{cfg.config or cfg.model} needs {e.name.split('.')[0]}, "
                "which is not installed: " + install_hint("lightning")
            )
        return usage_error(f"{'' if cfg.config else 'model: '}{short_error(str(e))}")
    except (OSError, ValueError, TypeError, ImportError) as e:
        # building --model raised: jsonargparse's Union report holds the reason
        return usage_error(f"{'' if cfg.config else 'model: '}{short_error(str(e))}")
    no_callback = swap is None
    swap = swap or {}
    backend = cfg.backend or swap.get("backend", "aten")
    include = cfg.include if cfg.include is not None else swap.get("include")
    exclude = cfg.exclude if cfg.exclude is not None else swap.get("exclude")
    sync: dict[str, Any] = (
        {}
        if cfg.program is not None
        else {  # (programs.plan takes no such argument)
            "sync_batchnorm": synced if cfg.sync_batchnorm is None else cfg.sync_batchnorm
        }
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = bnswap.plan(
                model, backend, include=include, exclude=exclude, device=cfg.device, **sync
            )  # (a program: one row per node)
    except (RuntimeError, ValueError, TypeError) as e:
        return usage_error(WARNING_PREFIX.sub("", str(e)))  # (one "bnswap" prefix)
    print_warnings(caught, "plan")  # a pattern that matches nothing: one line
    note = ""
    kernels = {r.kernel for r in plan.swapped}
    if any("(predicted)" in k for k in kernels):
        note = (
            f"note: no {torch.device(cfg.device).type} device here; the kernel column "
            "is what torch._C._select_batch_norm_backend picks on NVIDIA GPUs by its "
            "rule (aten/src/ATen/native/Normalization.cpp), predicted"
        )
    elif unprobed := sorted(k for k in kernels if k.startswith("n/a")):
        note = (
            f"note: the kernel for device {cfg.device or 'of the layers'!r} could not be "
            f"probed here ({', '.join(unprobed)}): is the device present?"
        )
    if backend == "ort" and not bnswap.ort.is_available():
        note = ((note + "\n") if note else "") + (
            "note: ONNX Runtime training is not installed here: converting with "
            f"backend='ort' raises ORTNotAvailableError ({bnswap.ort.INSTALL})"
        )
    if no_callback:  # (a stock config): say what training it really does
        note = ((note + "\n") if note else "") + (
            f"note: {cfg.config} has no BNSwap callback: `bnswap train` with it keeps stock "
            "BatchNorm; the table is what adding one would swap"
        )
    try:
        print(render(plan, cfg.format, note))
        sys.stdout.flush()
    except BrokenPipeError:  # `bnswap plan ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return exit_status(plan)
