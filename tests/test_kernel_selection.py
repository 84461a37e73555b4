"""Whether a swapped layer can run cuDNN, checked on any machine.

``torch._C._select_batch_norm_backend`` picks cuDNN for CUDA input only when, among
others, weight and bias are both defined and the running statistics are both defined
(or both absent in training), the input has at least 3 dimensions and is neither
bfloat16 nor float64 (aten/src/ATen/native/Normalization.cpp). On the CPU the test
checks the arguments bnswap's core hands the consolidated ops, recorded at dispatch
(a real ``TorchDispatchMode``, the ops themselves run); on a GPU it checks the choice.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bnswap

aten = torch.ops.aten
OPS = (aten._batch_norm_with_update.default, aten._batch_norm_no_update.default)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in OPS:
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


FLAGS = list(itertools.product([True, False], [True, False], [True, False], [0.1, None]))


@pytest.mark.parametrize("affine,track,training,momentum", FLAGS)
def test_the_core_hands_the_ops_what_cudnn_needs(affine, track, training, momentum):
    """Guards: an affine=False layer passing None for its bias (or weight) still runs on
    the CPU, bitwise as stock, but can never select cuDNN (and batch_norm_backward needs
    a weight): the eager parity tests cannot see it."""
    bn = bnswap.convert(nn.BatchNorm2d(5, affine=affine, track_running_stats=track,
                                       momentum=momentum)).train(training)
    x = torch.randn(4, 5, 3, 3)
    with Recorder() as rec:
        bn(x)
    assert len(rec.calls) == 1
    func, args = rec.calls[0]
    inp, weight, bias, mean, var = args[:5]
    uses_batch_stats = training or not track
    assert func is (OPS[0] if uses_batch_stats else OPS[1])
    for t in (weight, bias, mean, var):
        assert isinstance(t, torch.Tensor) and t.shape == (5,) and t.dtype == torch.float32
    if affine:
        assert weight is bn.weight and bias is bn.bias
    else:
        assert torch.equal(weight, torch.ones(5)) and torch.equal(bias, torch.zeros(5))
    if track and not (training and momentum is None):
        assert mean is bn.running_mean and var is bn.running_var
    assert inp.dim() >= 3


def test_plan_kernel_for_cuda_says_what_it_knows():
    """Guards: the check accepted "Cudnn" or "n/a" or any answer on a CUDA machine."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    row = bnswap.plan(model, device="cuda")[0]
    if torch.cuda.is_available():
        assert row.kernel == "Cudnn"
    else:  # torch's rule, for what the core passes
        assert row.kernel == "Cudnn (predicted)"
        tiny_eps = nn.Sequential(nn.BatchNorm2d(4, eps=1e-6))
        assert bnswap.plan(tiny_eps, device="cuda")[0].kernel == "Native (predicted)"
        bf16 = nn.Sequential(nn.BatchNorm2d(4)).to(torch.bfloat16)
        assert bnswap.plan(bf16, device="cuda")[0].kernel == "Native (predicted)"
    assert bnswap.plan(model, device="meta")[0].kernel == "n/a (meta)"
    assert bnswap.plan(model)[0].kernel == "Native"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("affine", [True, False])
def test_swapped_layers_select_cudnn_on_a_gpu(affine):
    bn = bnswap.convert(nn.BatchNorm2d(5, affine=affine)).cuda()
    x = torch.randn(4, 5, 3, 3, device="cuda")
    with Recorder() as rec:
        bn(x)
    (_, args), = rec.calls
    choice = torch._C._select_batch_norm_backend(*args[:5], True, args[6])
    assert str(choice).rsplit(".", 1)[-1] == "Cudnn"
