"""``python -m planner``: a number of the run config or the cluster out of its range (NaN, inf,
a zero divisor) is bad input -- exit 2, one ``error:`` line naming the field and value, no plan
printed (pretrain/config/numbers.py, planner/cluster.py CLUSTER_RULES)."""

from __future__ import annotations

import pytest

from planner.__main__ import main

TINY = ["curriculum=none", "trainer.global_batch_size=32", "trainer.micro_batch_size=4", "cluster=h100_80gb"]
CLUSTER = "error: bad cluster 'h100_80gb': cluster 'h100_80gb': "


@pytest.mark.parametrize("argument, line", [
    # a run field the plan does not use (it printed a plan) and a zero divisor (ZeroDivisionError)
    ("optimizer.weight_decay=inf", "error: invalid run config: optimizer.weight_decay=inf must be a finite number >= 0"),
    ("model.moe_router_groups=0", "error: invalid run config: model.moe_router_groups=0 must be >= 1"),
    # cluster fields: a bandwidth, a share, a ratio (inf passed "> 0" / ">= 1")
    ("cluster.hbm_gbps=inf", CLUSTER + "cluster.hbm_gbps=inf must be a finite number > 0"),
    ("cluster.moe_imbalance=inf", CLUSTER + "cluster.moe_imbalance=inf must be a finite number >= 1 (busiest rank / mean)"),
    ("cluster.matmul_efficiency=nan", CLUSTER + "cluster.matmul_efficiency=nan must be a finite number in (0, 1]"),
    ("cluster.nodes=0", CLUSTER + "cluster.nodes=0 must be >= 1"),
    ("plan.min_headroom=inf", "error: bad planner arguments: plan.min_headroom=inf: the share of GPU memory a "
                              "stage leaves free, a number in [0, 1)"),
])
def test_a_number_out_of_range_is_one_line_and_exit_2(capsys, argument, line):
    code = main([*TINY, argument])
    out, err = capsys.readouterr()
    assert (code, err, out) == (2, line + "\n", "")
