"""``python -m pretrain.torchrun``'s exit status from torchrun's failure report
(``ChildFailedError.failures``): 75 only when every failed rank exited with 75."""

from __future__ import annotations

import pytest

from pretrain.reliability.faults import PREEMPTED_EXIT


def _failures(**codes):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return {int(r[4:]): ProcessFailure(local_rank=int(r[4:]), pid=1000 + int(r[4:]), exitcode=c,
                                       error_file="<N/A>") for r, c in codes.items()}


@pytest.mark.parametrize("codes, status", [
    ({"rank0": 75, "rank1": 75}, PREEMPTED_EXIT),
    ({"rank1": 75}, PREEMPTED_EXIT),  # the agent stopped rank 0 (not a failure of its own)
    ({"rank0": 1}, 1),
    ({"rank0": 75, "rank1": 1}, 1),  # a rank crashed: not a clean preemption
    ({"rank0": 75, "rank1": -9}, 1),  # a rank killed before it saved
])
def test_torchrun_status_is_75_only_when_every_failed_rank_exited_75(codes, status):
    from pretrain.torchrun import exit_status

    assert exit_status(_failures(**codes)) == status
