"""bnswap adapters for BatchNorm subclasses of other libraries.

An adapter is a function ``adapter(layer, input)`` that does what the library class's
``forward`` does, calling :func:`bnswap.module_batch_norm` where that forward runs
``F.batch_norm`` and keeping the rest. Adapters are registered with
:func:`bnswap.register`; the built-in ones are registered by name in
:mod:`bnswap.registry` and imported only when a model holds their source class, so
``import bnswap`` imports no third-party library.

Built in:

* :mod:`bnswap.adapters.timm`: ``timm.layers.norm_act.BatchNormAct2d``,
  ``SyncBatchNormAct`` and ``timm.layers.split_batchnorm.SplitBatchNorm2d`` (imports timm).
"""
