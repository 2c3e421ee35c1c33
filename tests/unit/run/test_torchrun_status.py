"""``python -m pretrain.torchrun``'s exit status from torchrun's failure report
(``ChildFailedError.failures``, which also lists the ranks the agent stopped): 75 only when a rank
exited with 75 and every other failed rank did too or was stopped by the agent (SIGTERM/SIGKILL)."""

from __future__ import annotations

import pytest

from pretrain.reliability.faults import PREEMPTED_EXIT


def _failures(**codes):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return {int(r[4:]): ProcessFailure(local_rank=int(r[4:]), pid=1000 + int(r[4:]), exitcode=c,
                                       error_file="<N/A>") for r, c in codes.items()}


@pytest.mark.parametrize("codes, status", [
    ({"rank0": 75, "rank1": 75}, PREEMPTED_EXIT),
    ({"rank1": 75}, PREEMPTED_EXIT),
    ({"rank1": 75, "rank0": -15}, PREEMPTED_EXIT),  # the agent SIGTERMed rank 0 as it was exiting too
    ({"rank0": 75, "rank1": -9}, PREEMPTED_EXIT),  # rank 1 waited in the group's start: SIGKILLed 30 s on
    ({"rank0": 1}, 1),
    ({"rank0": -15, "rank1": -15}, 1),  # no rank saved and exited with 75
    ({"rank0": 75, "rank1": 1}, 1),  # a rank crashed: not a clean preemption
    ({"rank0": 75, "rank1": -11}, 1),
])
def test_torchrun_status_is_75_only_for_a_clean_preemption(codes, status):
    from pretrain.torchrun import exit_status

    assert exit_status(_failures(**codes)) == status
