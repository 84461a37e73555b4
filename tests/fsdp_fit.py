"""Train a small bnswap model under FSDP2 mixed precision on 2 gloo ranks (CPU), checking
every BatchNorm step against its reference, and save what each rank saw.

    python tests/fsdp_fit.py {plain|lightning} OUT_DIR PORT

``plain``: ``torch.multiprocessing.spawn`` of 2 ranks, ``fully_shard(model,
mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`` on a ``cpu`` device mesh,
3 SGD steps; first the same model with stock BatchNorm, which must fail.
``lightning``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1), accelerator="cpu", devices=2, callbacks=[BNSwap()])`` with the same
``fully_shard`` in ``configure_model`` (Lightning's launcher re-runs this script for rank 1).

The reference of each step (:class:`Reference`): stock ``nn.BatchNorm2d`` with float32
weight and bias equal to the bfloat16 Parameters FSDP2 gathered, float32 copies of the
running statistics, on the same bfloat16 input and output gradient. Each rank writes
OUT_DIR/<mode>_rank<r>.pt. Used by tests/test_fsdp.py.
"""

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from _helpers import COLLECTIVE_TIMEOUT_S
from torch import nn

torch.set_num_threads(1)  # two processes on two cores
warnings.filterwarnings("ignore", message=r".*(LeafSpec|does not have many workers).*")

STEPS = 3


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)
    )


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank r's input at a step (ranks see different batches)."""
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(100 * step + rank))


class Reference:
    """Hooks on one BatchNorm layer that record, for every training forward + backward,
    bnswap's output, input gradient and statistics next to the reference's."""

    def __init__(self, bn: nn.BatchNorm2d):
        self.bn = bn
        self.steps: list[dict] = []
        bn.register_forward_pre_hook(self._before)
        bn.register_forward_hook(self._after)

    def _before(self, bn, args):
        x = args[0]
        self.cur = {
            "input_dtype": x.dtype,
            "weight_dtype": bn.weight.dtype,
            "x": x.detach().clone(),
            "weight": bn.weight.detach().clone(),
            "bias": bn.bias.detach().clone(),
            "stats": [
                bn.running_mean.clone(),
                bn.running_var.clone(),
                bn.num_batches_tracked.clone(),
            ],
        }
        if x.requires_grad:
            x.register_hook(lambda g: self.cur.__setitem__("dx", g.detach().clone()))

    def _after(self, bn, args, out):
        self.cur["out"] = out.detach().clone()
        self.cur["stats_after"] = [
            bn.running_mean.clone(),
            bn.running_var.clone(),
            bn.num_batches_tracked.clone(),
        ]
        out.register_hook(lambda g: self.cur.__setitem__("dy", g.detach().clone()))
        self.steps.append(self.cur)

    def compare(self) -> list[dict]:
        """Per step: whether bnswap equals the reference bit for bit (output, input
        gradient, statistics), and this rank's reference weight / bias gradients cast to
        the Parameters' dtype (what FSDP2 reduces)."""
        rows = []
        for s in self.steps:
            ref = nn.BatchNorm2d(s["weight"].numel())
            with torch.no_grad():
                ref.weight.copy_(s["weight"].float())
                ref.bias.copy_(s["bias"].float())
                for buf, v in zip(
                    ("running_mean", "running_var", "num_batches_tracked"), s["stats"], strict=True
                ):
                    getattr(ref, buf).copy_(v)
            x = s["x"].clone().requires_grad_()
            out = ref(x)
            out.backward(s["dy"])
            after = [ref.running_mean, ref.running_var, ref.num_batches_tracked]
            rows.append(
                {
                    "dtypes": (
                        s["input_dtype"],
                        s["weight_dtype"],
                        s["out"].dtype,
                        s["stats_after"][0].dtype,
                        s["stats_after"][1].dtype,
                    ),
                    "out_equal": torch.equal(s["out"], out),
                    "dx_equal": torch.equal(s["dx"], x.grad),
                    "stats_equal": all(
                        torch.equal(a, b) for a, b in zip(s["stats_after"], after, strict=True)
                    ),
                    "ref_grads": [
                        ref.weight.grad.to(s["weight_dtype"]),
                        ref.bias.grad.to(s["weight_dtype"]),
                    ],
                }
            )
        return rows


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _plain_rank(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import bnswap

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        mesh = init_device_mesh("cpu", (2,))
        stock = fully_shard(make_net(), mesh=mesh, mp_policy=_policy())
        try:
            stock(batch(rank, 0))
            stock_error = None
        except RuntimeError as err:
            stock_error = str(err)
        net = bnswap.convert(make_net())
        check = Reference(net[1])
        fully_shard(net, mesh=mesh, mp_policy=_policy())
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = []
        for step in range(STEPS):
            opt.zero_grad()
            net(batch(rank, step)).float().square().mean().backward()
            grads.append([_full(net[1].weight.grad), _full(net[1].bias.grad)])
            opt.step()
        torch.save(
            {
                "stock_error": stock_error,
                "steps": check.compare(),
                "grads": grads,
                "swapped": bnswap.is_swapped(net[1]),
                "state": {k: _full(v).clone() for k, v in net.state_dict().items()},
            },
            os.path.join(out_dir, f"plain_rank{rank}.pt"),
        )
        dist.barrier()  # both ranks' results are written
    except BaseException:
        dist.destroy_process_group()
        raise
    # The rank ends here, without tearing down the process group or the interpreter:
    # FSDP2 left mid-forward by stock's RuntimeError above can abort that teardown
    # ("terminate called without an active exception", SIGABRT) after both ranks had
    # written their results (seen in 2 of 3 fresh-clone make test runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def plain(out_dir: str, port: int) -> None:
    torch.multiprocessing.spawn(_plain_rank, args=(port, out_dir), nprocs=2)


def lightning(out_dir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from bnswap.lightning import BNSwap

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()
            self.grads = []

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            self.check = Reference(self.net[1])  # BNSwap swapped the layer at setup
            self.swapped_at_configure_model = __import__("bnswap").is_swapped(self.net[1])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"], mp_policy=_policy())

        def training_step(self, b, i):
            return self.net(b[0]).float().square().mean()

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([_full(self.net[1].weight.grad), _full(self.net[1].bias.grad)])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(torch.utils.data.Dataset):  # rank r gets batch(r, step), as in `plain`
        def __len__(self):
            return STEPS

        def __getitem__(self, step):
            return (batch(int(os.environ.get("LOCAL_RANK", 0)), step),)

    model = Module()
    cb = BNSwap()
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(
            data_parallel_size=2,
            tensor_parallel_size=1,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        ),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader(Data(), batch_size=None)
    trainer.fit(model, loader)
    torch.save(
        {
            "steps": model.check.compare(),
            "grads": model.grads,
            "swapped_at_configure_model": model.swapped_at_configure_model,
            "plan": [(r.name, r.action) for r in cb.plan.rows],
            "state": {k: _full(v).clone() for k, v in model.state_dict().items()},
        },
        os.path.join(out_dir, f"lightning_rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "plain":
        plain(out, int(sys.argv[3]))
    else:
        lightning(out)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
