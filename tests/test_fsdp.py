"""FSDP2 mixed precision: BatchNorm with half Parameters and float32 statistics.

``fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`` casts
Parameters and inputs to bfloat16 and leaves buffers float32; stock BatchNorm then raises
(``RuntimeError: expected scalar type BFloat16 but found Float``). bnswap runs the
parameters upcast (``bnswap.functional.mixed_precision_params``): the reference, checked
bit for bit, is stock ``nn.BatchNorm`` with float32 weight and bias equal to the half
Parameters, on the same half input. Single process here; 2 gloo ranks with real FSDP2,
and Lightning's ``ModelParallelStrategy``, through tests/fsdp_fit.py.
"""

from __future__ import annotations

import copy
import socket
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import rank_env, run_processes

SCRIPT = Path(__file__).with_name("fsdp_fit.py")
HALF = [torch.bfloat16, torch.float16]


def _half_params(bn: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What FSDP2's param_dtype does to a layer: Parameters cast, buffers untouched."""
    for name, p in list(bn.named_parameters(recurse=False)):
        setattr(bn, name, nn.Parameter(p.detach().to(dtype)))
    return bn


def _layer(cls, dtype, momentum=0.1):
    torch.manual_seed(0)
    bn = cls(3, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.1, 0.1)
    return _half_params(bn, dtype)


def _reference(bn: nn.Module) -> nn.Module:
    """Stock layer, float32 weight and bias equal to ``bn``'s half ones."""
    ref = copy.deepcopy(bn)
    for name, p in list(ref.named_parameters(recurse=False)):
        setattr(ref, name, nn.Parameter(p.detach().float()))
    return ref


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(
    "cls,shape",
    [(nn.BatchNorm1d, (5, 3)), (nn.BatchNorm2d, (4, 3, 3, 3)), (nn.BatchNorm3d, (2, 3, 2, 2, 2))],
    ids=lambda v: getattr(v, "__name__", ""),
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_half_parameters_float_statistics_equal_stock_on_float_parameters(
    dtype, cls, shape, momentum
):
    """Two training steps then eval: output (the input's dtype), input gradient, running
    statistics (float32), counter bitwise the reference's; weight and bias gradients are
    the reference's cast to the Parameters' dtype. Stock refuses the layer."""
    bn = bnswap.convert(_layer(cls, dtype, momentum))
    ref = _reference(bn)
    bnswap.revert(ref)
    stock = copy.deepcopy(ref)
    _half_params(stock, dtype)
    with pytest.raises(RuntimeError, match=r"expected scalar type|mixed dtype"):
        stock(torch.randn(shape).to(dtype))
    for step, train in enumerate((True, True, False)):
        bn.train(train), ref.train(train)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = [bn(xs[0]), ref(xs[1])]
        assert outs[0].dtype == dtype and torch.equal(outs[0], outs[1])
        gy = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step)).to(dtype)
        for o in outs:
            o.backward(gy)
        assert torch.equal(xs[0].grad, xs[1].grad)
        for name in ("weight", "bias"):
            mine, want = getattr(bn, name), getattr(ref, name)
            assert mine.dtype == dtype and torch.equal(mine.grad, want.grad.to(dtype)), name
            mine.grad = want.grad = None
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(bn, name), getattr(ref, name)), name
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32


@pytest.mark.parametrize(
    "case", ["float64_statistics", "float16_params_bfloat16_input", "float32_input"]
)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_other_dtype_mismatches_keep_stocks_error(case, train):
    """Only half input + Parameters in its dtype + float32 statistics is run upcast; any
    other mismatch raises stock's exact error (and counts the batch as stock does: the
    kernel raises it)."""
    dtype = torch.float16 if case == "float16_params_bfloat16_input" else torch.bfloat16
    x = torch.randn(4, 3, 2, 2).to(torch.float32 if case == "float32_input" else torch.bfloat16)
    stock = _layer(nn.BatchNorm2d, dtype)
    if case == "float64_statistics":
        stock.running_mean = stock.running_mean.double()
        stock.running_var = stock.running_var.double()
    mine = bnswap.convert(copy.deepcopy(stock))
    errors = []
    for layer in (stock, mine):
        layer.train(train)
        with pytest.raises(RuntimeError) as err:
            layer(x)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    assert torch.equal(mine.num_batches_tracked, stock.num_batches_tracked)
    assert torch.equal(mine.running_var, stock.running_var)


# --------------------------------------------------------------------------- 2 ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, out: Path) -> list[dict]:
    env = rank_env()
    proc = run_processes(
        [sys.executable, str(SCRIPT), mode, str(out), str(_free_port())], timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    return [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _check_steps(ranks: list[dict]) -> None:
    """Every step on every rank bitwise the reference; the reduced gradients are the mean
    of the ranks' reference gradients in the Parameters' dtype (FSDP2's default
    reduce_dtype is param_dtype), held in the float32 shards."""
    steps = [r["steps"] for r in ranks]
    assert len(steps[0]) == len(steps[1]) == 3
    for s in range(3):
        for r in (0, 1):
            row = steps[r][s]
            # bf16 input and Parameters, bf16 output, float32 running statistics
            assert row["dtypes"] == (torch.bfloat16,) * 3 + (torch.float32,) * 2
            assert (row["out_equal"], row["dx_equal"], row["stats_equal"]) == (True,) * 3
        for p in (0, 1):  # weight, bias
            want = ((steps[0][s]["ref_grads"][p] + steps[1][s]["ref_grads"][p]) / 2).float()
            assert torch.equal(ranks[0]["grads"][s][p], want), (s, p)
            assert torch.equal(ranks[1]["grads"][s][p], want), (s, p)


@pytest.fixture(scope="module")
def plain_ranks(tmp_path_factory):
    return _run("plain", tmp_path_factory.mktemp("fsdp"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_bfloat16_trains_two_gloo_ranks_bitwise_the_reference(plain_ranks):
    """Real FSDP2 (``fully_shard`` on a ``cpu`` device mesh, gloo), param_dtype bfloat16:
    stock raises, bnswap trains 3 SGD steps, each equal to the reference."""
    ranks = plain_ranks
    for r in ranks:
        assert r["stock_error"] == "expected scalar type BFloat16 but found Float"
        assert r["swapped"]
    _check_steps(ranks)
    s0, s1 = ranks[0]["state"], ranks[1]["state"]
    assert s0["1.running_mean"].dtype == s0["1.weight"].dtype == torch.float32
    assert torch.equal(s0["1.weight"], s1["1.weight"])  # one sharded Parameter
    assert not torch.equal(s0["1.weight"], torch.ones(4))  # it trained
    # unsynchronized statistics: each rank's follow its own batches
    assert not torch.equal(s0["1.running_mean"], s1["1.running_mean"])
    assert int(s0["1.num_batches_tracked"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_model_parallel_strategy_fsdp2_bfloat16_on_cpu(tmp_path, plain_ranks):
    """Trainer(strategy=ModelParallelStrategy(data_parallel_size=2), accelerator="cpu",
    devices=2) + BNSwap(), fully_shard with param_dtype bfloat16 in configure_model: the
    layer is swapped before fully_shard, every step equals the reference, and the final
    state is bitwise the plain FSDP2 run's."""
    ranks = _run("lightning", tmp_path)
    for r in ranks:
        assert r["swapped_at_configure_model"]
        assert r["plan"] == [("net.1", "swap")]
    _check_steps(ranks)
    for r in (0, 1):
        mine = ranks[r]["state"]
        assert [
            k for k, v in plain_ranks[r]["state"].items() if not torch.equal(mine["net." + k], v)
        ] == []


def test_lightning_fsdp_strategy_refuses_cpu():
    """Lightning's FSDP (FSDP1) strategy needs CUDA: on CPU it refuses at Trainer
    construction (benchmarks/gpu_check.py covers the GPU)."""
    pl = pytest.importorskip("lightning.pytorch")
    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp")
