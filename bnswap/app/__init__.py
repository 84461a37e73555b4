"""The demo application: the ``bnswap`` console script (LightningCLI) and its main job.

Apart from the library: it imports Lightning, scikit-learn and matplotlib itself (the
``bnswap[lightning]`` extra), and the library never imports it.

* :mod:`bnswap.app.cli`: the ``bnswap`` console script's Lightning subcommands
  (``train`` / ``validate`` / ``test`` / ``predict`` / ``compare``; the front door,
  ``_bnswap_command``, dispatches to them);
* :mod:`bnswap.app.plan_cli`: ``bnswap plan``;
* :mod:`bnswap.app.convert_cli`: ``bnswap convert``;
* :mod:`bnswap.app.plan_output`: what both print (a plan as a table, JSON or markdown)
  and their exit status;
* :mod:`bnswap.app.task`: the LightningModule (an image classifier);
* :mod:`bnswap.app.data`: the LightningDataModule (scikit-learn's digits);
* :mod:`bnswap.app.digits`: the digits data as tensors;
* :mod:`bnswap.app.models`: small image classifiers built from stock ``torch.nn`` layers.
"""
