"""Train Ultralytics' YOLOv8n (built from its bundled yaml, no weights) on a tiny data set
this script writes, stock or with bnswap's recipe, in two phases: the run stops after its
first checkpoint, then resumes from ``last.pt``.

    python tests/ultralytics_fit.py {stock|bnswap|callback} {first|resume} ROOT

The recipes of docs/recipes.md: ``bnswap``, a trainer whose ``get_model`` returns
``bnswap.convert(super().get_model(...))`` (``YOLO(...).train(trainer=...)``): its EMA
copy (``copy.deepcopy`` of the model) is swapped with it, and a resume builds the model
through ``get_model`` again; ``callback``, an ``on_pretrain_routine_end`` callback that
converts ``trainer.model`` and ``trainer.ema.ema``. Prints, as its last line, a JSON list
with the number of swapped layers in the model and in the EMA copy at every training step. Used by
tests/test_recipes.py (the zoo environment: Ultralytics needs torchvision).
"""

import json
import os
import sys

import numpy as np
import torch
from PIL import Image

torch.set_num_threads(1)

from ultralytics import YOLO  # noqa: E402
from ultralytics.models.yolo.detect import DetectionTrainer  # noqa: E402

import bnswap  # noqa: E402


class BNSwapTrainer(DetectionTrainer):
    def get_model(self, cfg=None, weights=None, verbose=True):
        return bnswap.convert(super().get_model(cfg, weights, verbose))


def dataset(root: str) -> str:
    """4 train and 4 val 64x64 random images, one box each, two classes: data.yaml."""
    d = os.path.join(root, "data")
    if os.path.exists(os.path.join(d, "data.yaml")):
        return os.path.join(d, "data.yaml")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        os.makedirs(os.path.join(d, "images", split))
        os.makedirs(os.path.join(d, "labels", split))
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(
                os.path.join(d, "images", split, f"{i}.png")
            )
            with open(os.path.join(d, "labels", split, f"{i}.txt"), "w") as f:
                f.write(f"{i % 2} 0.5 0.5 0.4 0.3\n")
    with open(os.path.join(d, "data.yaml"), "w") as f:
        f.write(f"path: {d}\ntrain: images/train\nval: images/val\nnames:\n  0: a\n  1: b\n")
    return os.path.join(d, "data.yaml")


def main(kind: str, phase: str, root: str) -> None:
    trainer = BNSwapTrainer if kind == "bnswap" else DetectionTrainer
    seen = []

    def count(tr):
        seen.append(
            [
                sum(bnswap.is_swapped(m) for m in tr.model.modules()),
                sum(bnswap.is_swapped(m) for m in tr.ema.ema.modules()),
            ]
        )

    def stop_after_first_checkpoint(tr):
        raise SystemExit(3)

    last = os.path.join(root, kind, "run", "weights", "last.pt")
    if phase == "first":
        yolo = YOLO("yolov8n.yaml")
        yolo.add_callback("on_model_save", stop_after_first_checkpoint)
    else:
        yolo = YOLO(last)
    yolo.add_callback("on_train_batch_end", count)
    if kind == "callback":
        yolo.add_callback(
            "on_pretrain_routine_end",
            lambda tr: (bnswap.convert(tr.model), bnswap.convert(tr.ema.ema)),
        )
    try:
        if phase == "first":
            yolo.train(
                trainer=trainer,
                data=dataset(root),
                epochs=2,
                imgsz=64,
                batch=2,
                workers=0,
                device="cpu",
                plots=False,
                val=False,
                amp=False,
                deterministic=True,
                seed=0,
                project=os.path.join(root, kind),
                name="run",
                exist_ok=True,
                verbose=False,
            )
        else:
            yolo.train(trainer=trainer, resume=True)
    finally:
        print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
