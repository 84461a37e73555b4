"""bnswap adapters for BatchNorm subclasses of other libraries.

An adapter is a thin subclass of the library's BatchNorm class and
:class:`bnswap.layers.BNSwapLayer` whose ``forward`` runs
:meth:`~bnswap.layers.BNSwapLayer._bnswap_normalize` where the library's forward runs
``F.batch_norm`` and keeps the rest of that forward. Adapters are registered with
:func:`bnswap.register`; the built-in ones are registered by name in
:mod:`bnswap.registry` and imported only when a model holds their source class, so
``import bnswap`` imports no third-party library.

Built in:

* :mod:`bnswap.adapters.timm`: ``timm.layers.norm_act.BatchNormAct2d`` (imports timm).
"""
