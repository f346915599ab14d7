"""SharedRegion: the pages a spawned process maps are this process's, both ways, with memfd and with
torch's shared memory."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from lora_core import shared_region
from lora_core.shared_region import SharedRegion
from tests.timeouts import CHILD_PROCESS_TIMEOUT_S, HANG_TIMEOUT_S


def _child(region: SharedRegion, done) -> None:
    t = region.tensor
    seen = int(t[: 1 << 20].sum())  # what the parent wrote, read back from the child's own mapping
    t[-4096:] = 7  # and a write for the parent to see
    done.send((seen, region.nbytes, t.numel()))


@pytest.mark.parametrize("memfd", [True, False])
def test_a_spawned_process_maps_the_same_pages(memfd):
    if memfd and not shared_region.MEMFD:
        pytest.skip("no memfd_create on this OS")
    nbytes = (8 << 20) + 123  # not a multiple of the page size
    region = SharedRegion(nbytes, memfd=memfd)
    assert (region.fd is not None) == memfd and region.tensor.numel() == nbytes
    region.tensor[: 1 << 20] = 3
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(region, child_end))
    proc.start()
    try:
        assert parent_end.poll(CHILD_PROCESS_TIMEOUT_S), "the child sent nothing"
        assert parent_end.recv() == (3 << 20, nbytes, nbytes)
    finally:
        proc.join(HANG_TIMEOUT_S)
    assert proc.exitcode == 0
    assert torch.equal(region.tensor[-4096:], torch.full((4096,), 7, dtype=torch.uint8))
    assert int(region.tensor[(1 << 20):-4096].sum()) == 0  # fresh pages read zero


def test_room_is_memory_with_memfd_and_dev_shm_without(monkeypatch):
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 0, 0, 0, 0, 255))  # /dev/shm with no block free
    monkeypatch.setattr(shared_region.os, "statvfs", lambda path: full)
    assert shared_region.room_for(1 << 40) == shared_region.MEMFD
    monkeypatch.setattr(shared_region, "MEMFD", False)
    assert not shared_region.room_for(1)
    monkeypatch.setattr(shared_region.os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 100, 10, 10) + (0,) * 5))
    assert shared_region.room_for(40960) and not shared_region.room_for(40961)


def test_memfd_is_probed_not_assumed(monkeypatch):
    """A kernel or sandbox that refuses memfd_create leaves regions in torch's shared memory."""
    def refused(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(shared_region.os, "memfd_create", refused, raising=False)
    assert not shared_region._memfd_works()
    monkeypatch.delattr(shared_region.os, "memfd_create", raising=False)
    assert not shared_region._memfd_works()
