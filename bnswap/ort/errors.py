"""Every error the ONNX Runtime backend raises, under one base class.

``except bnswap.ort.ORTBackendError`` catches anything the backend refused; each class
also derives from the builtin it resembles, so ``except ImportError`` /
``except RuntimeError`` keep working. The backend recognises failures by these types,
never by the text of a message.

=========================  ==============  ==================================================
class                      also a          raised when
=========================  ==============  ==================================================
ORTNotAvailableError       ImportError     onnxruntime-training / torch-ort not installed
UnsupportedLayerError      TypeError       a BatchNorm layer ORT cannot run (not swapped, not
                                           float32, not on CPU / CUDA, uninitialized lazy)
UnsupportedVersionError    RuntimeError    an ORT / torch pair bnswap was not tested with
BuildError                 RuntimeError    ORT's C++ extension cannot be built
ORTRunError                RuntimeError    ORT cannot export, build or run the model
StatsNotWrittenError       ORTRunError     ORT did not write a layer's batch statistics
LayerRunsTwiceError        ORTRunError     a BatchNorm layer runs more than once per forward
=========================  ==============  ==================================================

Wrong arguments (a non-Module, an unknown ``fallback``) are plain ``TypeError`` /
``ValueError``, as in torch.

Examples::

    >>> from bnswap.ort.errors import ORTBackendError, ORTNotAvailableError
    >>> issubclass(ORTNotAvailableError, (ORTBackendError, ImportError))
    True
"""

from __future__ import annotations

__all__ = [
    "BuildError",
    "LayerRunsTwiceError",
    "ORTBackendError",
    "ORTNotAvailableError",
    "ORTRunError",
    "StatsNotWrittenError",
    "UnsupportedLayerError",
    "UnsupportedVersionError",
]


class ORTBackendError(Exception):
    """Base class: anything bnswap's ONNX Runtime backend refused."""


class ORTNotAvailableError(ORTBackendError, ImportError):
    """onnxruntime-training (with ORTModule) or torch-ort is not installed."""


class UnsupportedLayerError(ORTBackendError, TypeError):
    """A BatchNorm layer ORT cannot run: not swapped (ORT would export it with a momentum
    frozen at trace time), parameters not float32, not on CPU / CUDA, or an uninitialized
    lazy layer (nothing to export yet)."""


class UnsupportedVersionError(ORTBackendError, RuntimeError):
    """The installed onnxruntime-training / torch pair is not one bnswap was tested with
    (``BNSWAP_ORT_ALLOW_UNTESTED=1`` turns it into a warning)."""


class BuildError(ORTBackendError, RuntimeError):
    """ORT's C++ extension could not be built (no compiler, or the compile failed)."""


class ORTRunError(ORTBackendError, RuntimeError):
    """ONNX Runtime could not export, build or run the model (no silent fallback: pass
    ``fallback="aten"`` to ``bnswap.ort.wrap`` to run it eagerly instead)."""


class StatsNotWrittenError(ORTRunError):
    """ORT did not write a layer's batch statistics into its running_mean buffer, so its
    running statistics cannot follow PyTorch's rule."""


class LayerRunsTwiceError(ORTRunError):
    """A BatchNorm layer runs more than once in one forward (ORT would update its
    statistics once per call site into the same buffers)."""
