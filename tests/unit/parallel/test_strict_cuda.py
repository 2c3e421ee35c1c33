"""The strict CUDA emulation's mechanism, op by op (``parallel/megatron_compat/strict_cuda.py``):
residency follows storages through ops, views and moves; mixes raise CUDA's message; host syncs
are counted; collectives on NCCL-like groups refuse host tensors. Training runs under it are in
``tests/distributed/test_strict_emulation.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.megatron_compat import cpu_emulation, strict_cuda

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation is for CUDA-less hosts")


@pytest.fixture
def strict():
    with cpu_emulation.strict_mode():
        strict_cuda.take_host_syncs()
        yield


def test_residency_follows_creation_ops_views_and_moves(strict):
    dev = torch.zeros(4, 3, device="cuda")
    host = torch.zeros(4, 3)
    assert dev.device == torch.device("cuda", 0) and dev.is_cuda and host.device.type == "cpu"
    assert (dev * 2 + 1).is_cuda and dev[1:].is_cuda and dev.t().is_cuda
    assert torch.zeros(2, device=dev.device).is_cuda  # device=x.device follows x, as on a GPU
    assert torch.nn.Parameter(dev).is_cuda
    moved = host.cuda()
    assert moved.is_cuda and not host.is_cuda  # a move is a copy: the host tensor stays
    back = dev.to("cpu")
    assert not back.is_cuda and dev.is_cuda
    linear = torch.nn.Linear(3, 2)
    linear.to(torch.cuda.current_device())
    assert linear.weight.is_cuda and linear(dev).is_cuda


def test_mixing_device_and_host_raises_naming_the_op(strict):
    dev, host = torch.ones(3, device="cuda"), torch.ones(3)
    with pytest.raises(RuntimeError, match=r"cuda:0 and cpu! \(when checking arguments for aten::add\.Tensor"):
        dev + host
    with pytest.raises(RuntimeError, match=r"aten::addmm|aten::mm|aten::linear"):
        torch.nn.Linear(3, 3)(dev[None])
    assert (dev + torch.tensor(2.0)).is_cuda  # a 0-dim host tensor is a scalar, as on CUDA
    dev.copy_(host)  # copies across devices are allowed
    assert dev[torch.tensor([0, 2])].is_cuda  # host indices are allowed


def test_indexing_mixes_follow_cuda_rules(strict):
    """As CUDA: a device tensor takes host indices, a host tensor refuses device indices (read or
    write), and index_put_ into a device tensor takes device values or a 0-dim host scalar."""
    dev, host = torch.arange(4.0, device="cuda"), torch.arange(4.0)
    dev_idx, host_idx = torch.tensor([0, 2], device="cuda"), torch.tensor([0, 2])
    assert dev[host_idx].is_cuda and dev[dev_idx].is_cuda and not host[host_idx].is_cuda
    with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device .*aten::index\.Tensor"):
        host[dev_idx]
    with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device .*aten::index_put_"):
        host[dev_idx] = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"cpu and cuda:0! \(when checking argument values for aten::index_put_"):
        host[host_idx] = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match=r"cuda:0 and cpu! \(when checking argument values for aten::index_put_.*shape \(2,\)"):
        dev[host_idx] = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"argument values for aten::index_put_"):
        dev.index_put_((dev_idx,), torch.ones(2), accumulate=True)
    dev[host_idx] = torch.tensor(5.0)  # a 0-dim host value is a scalar
    dev[dev_idx] = torch.ones(2, device="cuda")
    dev[torch.tensor([True, False, False, True])] = 7.0
    assert dev.tolist() == [7.0, 1.0, 1.0, 7.0] and dev.is_cuda


def test_host_syncs_are_counted_not_raised(strict):
    dev = torch.arange(6.0, device="cuda")
    dev.sum().item()
    bool(dev.max() > 0)
    dev.tolist()
    dev.nonzero()
    dev.cpu()
    torch.cuda.current_stream().synchronize()
    torch.ones(3).sum().item()  # host tensors never sync
    dev.to("cpu", non_blocking=True)  # the wait comes at the synchronize
    assert strict_cuda.take_host_syncs() == 6
    assert strict_cuda.take_host_syncs() == 0
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        dev.numpy()


def test_tensors_made_inside_kernels_do_not_count_as_host(strict):
    """The autograd engine zero-fills missing gradients in C++ (here: the unused half of a
    split); those tensors take the residency of what they meet."""
    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    first, _ = x.split(2)
    first.sum().backward()
    assert x.grad.is_cuda


def test_collectives_refuse_host_tensors_except_on_gloo_groups(one_rank, strict):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu: c10d::allreduce_"):
        dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2, device="cuda"))
    gloo = dist.new_group(ranks=[0], backend="gloo")
    dist.all_reduce(torch.ones(2), group=gloo)  # megatron's explicit gloo groups take host tensors
    out = [None]
    dist.all_gather_object(out, {"a": 1})  # object collectives serialise onto the device
    assert out == [{"a": 1}]


def test_leaving_strict_mode_restores_plain_tensors():
    cpu_emulation.install()
    with cpu_emulation.strict_mode():
        dev = torch.ones(2, device="cuda")
        assert dev.is_cuda
    assert not dev.is_cuda and dev.device.type == "cpu"
    assert torch.ones(2, device="cuda").device.type == "cpu"  # plain: CUDA maps to the CPU


def test_dispatch_handler_is_not_wrapped_per_op():
    """Every aten op of a strict run passes through ``__torch_dispatch__``: torch's default
    ``torch._disable_dynamo`` wrapper around it cost a tenth of a strict step. The mode opts out;
    a torch upgrade that wraps it anyway (or renames the opt-out) shows here."""
    handler = strict_cuda.DeviceResidencyMode.__dict__["__torch_dispatch__"]
    assert handler.__qualname__ == "DeviceResidencyMode.__torch_dispatch__"
    assert not hasattr(handler, "__wrapped__"), handler


def test_nested_arguments_and_results_keep_their_residency(strict):
    """Ops whose arguments are lists (cat, stack) or whose results are tuples (split, max with
    dim) are checked and tagged through the nesting."""
    dev, host = torch.ones(2, 3, device="cuda"), torch.ones(2, 3)
    assert torch.cat([dev, dev]).is_cuda
    with pytest.raises(RuntimeError, match=r"cuda:0 and cpu! \(when checking arguments for aten::cat"):
        torch.cat([dev, host])
    values, indices = dev.max(dim=1)
    assert values.is_cuda and indices.is_cuda
    assert all(part.is_cuda for part in dev.split(1))
