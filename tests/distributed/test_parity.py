"""The central test: the tiny GLM-5 trained 5 steps (fp32, same initial weights, same data, same
global batch) gives the same training under every parallel layout as on one rank -- with Adam and
Muon Split, in every DSA mode, with context parallelism on packed long documents.

One row per case (:class:`tests.support.parity.Row`): a new case is one line. How runs are
compared, and why at that tolerance: :mod:`tests.support.parity`.
"""

import pytest

from tests.support.parity import Harness, Row

TP2 = ("parallel.tp=2", "parallel.sequence_parallel=true")
PACKED_YARN = ("data.mixture=long_context", "model.rope_type=yarn", "model.yarn.factor=4",
               "model.yarn.original_max_position_embeddings=256")
ROWS = [
    # layouts (Adam, dense attention)
    Row("tp2_pp2", 4, ("parallel=tp2_pp2",)),
    Row("tp2_sp_ep2", 4, ("parallel=tp2_sp_ep2",)),
    Row("pp2_vpp2", 4, ("parallel=pp2_vpp2",)),
    # PP2 x VPP2 on DP1: enough micro-batches for the interleaved 1F1B steps, whose exchanges
    # send activations and gradients both ways between the same two ranks in one batch
    Row("pp2_vpp2_dp1", 2, ("parallel.pp=2", "parallel.vpp=2")),
    Row("dp2_distopt", 2, ("parallel=dp2_distopt",)),
    Row("ep4", 4, ("parallel=ep4",)),
    # megatron's flexible pipeline layout: an uneven split and a last stage holding only the
    # MTP module and the loss (no decoder layer)
    Row("layout_mtp_loss_stage", 4, ("parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout='Et|tt|t|mL'")),
    # DP overlap: gradients reduce-scattered bucket by bucket during backward, parameters
    # all-gathered by the next forward's pre-hooks (and in full before the checkpoint save)
    Row("dp2_overlap_grad_param", 2, ("parallel=dp2_distopt", "parallel.overlap_grad_reduce=true",
                                      "parallel.overlap_param_gather=true")),
    # DeepSeek-V3 at toy size (no DSA indexer, 8 experts in 4 groups top-2 groups, YaRN, MTP x1):
    # the layout splits heads and experts, and routes across EP ranks by group
    Row("deepseek_v3_tiny_tp2_sp_ep2", 4, ("parallel=tp2_sp_ep2",), dsa_mode="none", shape="deepseek_v3_tiny"),
    # Muon Split: TP gathers each TP-sharded whole matrix before orthogonalising (per-head
    # up-projection blocks stay local); the distributed optimizer rebuilds whole matrices from
    # the ranks' flat shards; the last stage's MTP copy of the word embedding is stepped like the
    # first stage's
    Row("muon_tp2", 2, TP2, optimizer="muon_split"),
    Row("muon_dp2_distopt", 2, ("parallel=dp2_distopt",), optimizer="muon_split"),
    Row("muon_tp2_dp2_distopt", 4, (*TP2, "parallel.distributed_optimizer=true"), optimizer="muon_split"),
    Row("muon_pp2", 2, ("parallel.pp=2",), optimizer="muon_split"),
    # sparse DSA under TP (+SP): the indexer's partial projections summed over TP ranks
    Row("sparse_tp2", 2, TP2, dsa_mode="sparse", extra=("model.dsa.kernels=torch",)),
    # context parallelism (all-gather CP for MLA + DSA) in every DSA mode, and on packed
    # documents (document masks, position resets) with YaRN past its original context (MLA's
    # rotary sliced per CP rank, the indexer's at the queries' global positions)
    Row("dense_cp2", 2, ("parallel=cp2",), shape="long", memory_as_planned=False),
    Row("warmup_cp2", 2, ("parallel=cp2",), dsa_mode="warmup", shape="long", memory_as_planned=False),
    # the warm-up's frozen forward across pipeline stages: each stage's input gets a zero gradient
    # to send back, the KLs' gradients reach the indexers in every chunk (MTP's last)
    Row("warmup_pp2_vpp2", 2, ("parallel.pp=2", "parallel.vpp=2"), dsa_mode="warmup"),
    Row("sparse_cp2", 2, ("parallel=cp2",), dsa_mode="sparse", shape="long", memory_as_planned=False),
    Row("packed_yarn_sparse_cp2", 2, ("parallel=cp2",), dsa_mode="sparse", shape="long", extra=PACKED_YARN,
        memory_as_planned=False),
    Row("packed_yarn_sparse_cp2_tp2", 4, ("parallel=cp2_tp2",), dsa_mode="sparse", shape="long",
        extra=PACKED_YARN, memory_as_planned=False),
]
BY_NAME = {r.name: r for r in ROWS}
ADAM_ROW, MUON_ROW = BY_NAME["tp2_pp2"], BY_NAME["muon_tp2"]  #: the references the last two tests read


@pytest.fixture(scope="session")
def parity(tmp_path_factory):
    return Harness(tmp_path_factory.mktemp("parity"))


@pytest.mark.heavy
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_layout_trains_as_one_rank(parity, row):
    parity.check(row)


@pytest.mark.heavy
def test_one_rank_references_use_planned_memory(parity):
    from tests.support.parity import assert_memory_as_planned

    for row in (ADAM_ROW, MUON_ROW):  # Adam; Muon (momentum and the zero exp_avg_sq, Adam for the rest)
        assert_memory_as_planned(parity.reference_dir(row))


@pytest.mark.heavy
def test_muon_moves_away_from_adam(parity):
    """The Muon rows compare the Muon path: from the same start its losses part from Adam's once
    an update with LR > 0 was applied (the first runs at LR 0: warm-up from 0)."""
    adam, _ = parity.reference(ADAM_ROW)
    muon, _ = parity.reference(MUON_ROW)
    assert muon[1]["lm_loss"] == pytest.approx(adam[1]["lm_loss"], rel=1e-12)
    for m, a in zip(muon[2:], adam[2:]):
        assert abs(m["lm_loss"] - a["lm_loss"]) > 1e-3, m["step"]
