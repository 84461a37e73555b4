"""The main job's logger: Lightning's ``CSVLogger`` whose ``save_dir`` may be left out."""

from __future__ import annotations

from lightning.pytorch.loggers import CSVLogger as _CSVLogger

__all__ = ["CSVLogger"]


class CSVLogger(_CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` with ``save_dir`` optional.

    Left out (None), ``bnswap train`` sets it to ``--trainer.default_root_dir``, so moving
    the run moves its logs; given, it is used as it is. Outside the CLI None means the
    current folder.

    Args:
        save_dir: the folder the logs go under; None: see above.
        name, version, prefix, flush_logs_every_n_steps: as Lightning's ``CSVLogger``.
    """

    def __init__(
        self,
        save_dir: str | None = None,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(
            save_dir if save_dir is not None else ".",
            name=name,
            version=version,
            prefix=prefix,
            flush_logs_every_n_steps=flush_logs_every_n_steps,
        )
