"""The per-rank model-space optimizer format's geometry: a rank's flat shard of a parameter cut
into boxes that are exactly that range, and a factory it cannot cut refused by name. (The save
at one layout and the load at another, bit for bit against megatron's gathered format, is
``tests/distributed/test_checkpoint_scale.py::test_stage_end_save_holds_only_its_own_share``.)"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from parallel.megatron_compat.model_space_shards import _pieces, boxes


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (1, 6), (2, 3, 4), (3, 1, 2, 2)])
def test_boxes_are_the_flat_range_in_order(shape):
    numel = int(torch.tensor(shape).prod()) if shape else 1
    grid = torch.arange(numel).view(shape)
    for lo, hi in itertools.combinations(range(numel + 1), 2):
        got = boxes(shape, lo, hi)
        assert len(got) <= max(1, 2 * len(shape) - 1), (lo, hi, got)
        flat = []
        for offset, box, fa, fb in got:
            index = tuple(slice(o, o + n) for o, n in zip(offset, box))
            values = grid[index].reshape(-1).tolist()
            assert values == list(range(fa, fb)), (lo, hi, offset, box)  # contiguous: a view of the shard
            flat += values
        assert flat == list(range(lo, hi)), (shape, lo, hi)


def test_empty_range_has_no_boxes():
    assert boxes((4, 4), 5, 5) == []


@dataclass
class _TransposingFactory:
    """A checkpoint factory that saves the transpose (megatron's legacy GroupedMLP does)."""

    key: str
    data: torch.Tensor
    replica_id: tuple = (0, 0, 0)

    def build(self):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        t = self.data.t()
        return [ShardedTensor.from_rank_offsets(self.key, t, replica_id=self.replica_id)]


def test_a_factory_of_non_contiguous_views_is_refused_by_name():
    param = torch.nn.Parameter(torch.zeros(4, 6))
    with pytest.raises(NotImplementedError, match=r"experts\.linear_fc1\.weight: its checkpoint factory builds "
                                                  r"a non-contiguous view"):
        _pieces(_TransposingFactory("experts.linear_fc1.weight", param), param)


def test_swiglu_halves_are_cut_where_they_lie_in_the_parameter():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    param = torch.nn.Parameter(torch.zeros(8, 3))  # TP rank 1 of 2: [w; v] halves of 4 rows each
    sh = ShardedTensor.from_rank_offsets("mlp.linear_fc1.weight", param, (0, 1, 2), replica_id=(0, 0, 0))
    pieces = _pieces(apply_swiglu_sharded_factory(sh, ()), param)
    assert [(p.key, p.global_offset, start) for p, start in pieces] == [
        ("mlp.linear_fc1.weight", (4, 0), 0), ("mlp.linear_fc1.weight", (12, 0), 12)]
