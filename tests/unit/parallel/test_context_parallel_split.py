"""The zigzag layout the CP attention assumes is exactly megatron's batch split, and the gathered
rank-ordered chunks are put back in natural order."""

import pytest
import torch
import torch.distributed as dist
from megatron.core.utils import get_batch_on_this_cp_rank

from parallel.context_parallel import _natural_order, zigzag_positions


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(scope="module")
def dist_initialised(tmp_path_factory):
    """megatron's splitter treats every group as size 1 until torch.distributed is up."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_positions_are_megatrons_split_and_reassemble_in_order(dist_initialised, monkeypatch, cp):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size())  # a stand-in group
    monkeypatch.setattr(dist, "get_rank", lambda group=None: group.rank())
    length = 8 * cp
    full = torch.arange(length)[None]
    local = [get_batch_on_this_cp_rank({"tokens": full.clone()}, is_hybrid_cp=False, cp_group=_Group(cp, r))["tokens"][0]
             for r in range(cp)]
    for r in range(cp):
        assert zigzag_positions(length // cp, cp, r).tolist() == local[r].tolist()
    gathered = torch.cat(local).view(2 * cp, 4)  # what all_gather returns, rank by rank
    assert gathered.index_select(0, _natural_order(cp)).flatten().tolist() == list(range(length))
    assert zigzag_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
