"""The host-synchronisation counter (runtime/host_sync.py) sees what it is meant to see."""

from __future__ import annotations

import torch

from megatron_mlmclm.runtime.host_sync import HostSyncCounter, on_host


def test_every_kind_of_wait_is_counted_once_with_its_line():
    x = torch.arange(12.0).view(3, 4)
    mask = x > 5
    with HostSyncCounter() as c:
        x.sum().item()  # a scalar read
        bool(x.max() > 3)  # a scalar read through __bool__
        x[mask]  # boolean-mask indexing (nonzero underneath)
        torch.nonzero(x)
        torch.equal(x, x)
        x.tolist()  # a read of the whole tensor
        torch.tensor([1, 2], device=x.device)  # a blocking copy to the device
        torch.repeat_interleave(torch.tensor([1, 2]))  # output size from the data
    assert c.by_op == {
        "_local_scalar_dense": 2,
        "index (boolean mask)": 1,
        "nonzero": 1,
        "equal": 1,
        "Tensor.tolist": 1,
        "torch.tensor(device=...)": 1,
        "repeat_interleave": 1,
    }, c.report()
    assert c.total == 8
    assert all("test_host_sync.py" in site for _, site in c.by_site), c.report()


def test_what_never_waits_is_not_counted():
    x = torch.randn(4, 8, requires_grad=True)
    index = torch.tensor([0, 2])  # built before counting: a host tensor
    with HostSyncCounter() as c:
        y = x.index_select(0, index) * 2  # integer indexing: no data-dependent size
        torch.repeat_interleave(index, torch.tensor([1, 1]), output_size=2)
        z = torch.where(x > 0, x, 0.0).sum()
        (y.sum() + z).backward()
        torch.full((), 3, device=x.device)  # filled on the device, no copy
    assert c.total == 0, c.report()


def test_host_work_is_left_out_and_the_patches_are_undone():
    tolist = torch.Tensor.tolist
    with HostSyncCounter() as c:
        with on_host():
            t = torch.arange(10)
            t[t > 3].tolist()
            torch.tensor([1], device="cpu")
        t.sum().item()
    assert c.by_op == {"_local_scalar_dense": 1}, c.report()
    assert torch.Tensor.tolist is tolist
