"""megatron's EP all-to-all overlap (``parallel.overlap_moe_expert_parallel_comm``) runs on CPU
ranks: its combined 1F1B schedule interleaves one micro-batch's forward nodes with another's
backward nodes (CUDA streams and events are no-ops here, so nothing overlaps, but every node runs
as on a GPU). The tiny GLM-5 trains as with megatron's plain interleaved 1F1B schedule, at EP2 x
PP2 x VPP2 in bf16 (megatron allows the overlap only in bf16 / fp16) with selective recompute
under the strict CUDA emulation: bit for bit with one MTP step, and with GLM-5's shared MTP
module applied 3 times up to the order its three gradients are summed in.

The overlapped runs also ask for megatron's high-priority all-to-all stream
(``parallel.high_priority_a2a_comm_stream``: created through the CPU emulation's
``torch.cuda.Stream.priority_range``; a stream priority changes no result).

It fails without either of ``megatron_compat.schedule_plan``'s adaptations: without the
micro-batch bound to the plan's nodes the attention refuses to run outside one; without the MTP
depths collected as the nodes' own leaves the second depth's backward runs through a freed graph.
"""

import pytest

from tests.support.launch import read_metrics, run_train

LAYOUT = ["parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "precision=bf16", "model.recompute=selective",
          "model.recompute_modules=[mla_up_proj]",
          "parallel.cpu_emulation=strict", "trainer.steps=3", "checkpoint.save_at_end=false"]
KEYS = ("lm_loss", "loss", "grad_norm")


def _plain_and_overlapped(root, mtp_steps: int):
    runs = {}
    for overlap in (False, True):
        run_dir = root / f"mtp{mtp_steps}_overlap_{overlap}"
        on = str(overlap).lower()  # the overlapped run's all-to-all stream at high priority too
        summary = run_train([*LAYOUT, f"model.mtp_num_steps={mtp_steps}", f"trainer.run_dir={run_dir}",
                             f"parallel.overlap_moe_expert_parallel_comm={on}",
                             f"parallel.high_priority_a2a_comm_stream={on}"], nproc=4)
        assert summary["steps"] == 3, summary
        runs[overlap] = read_metrics(str(run_dir))
    plain, overlapped = runs[False], runs[True]
    assert [r["step"] for r in overlapped] == [1, 2, 3]
    # the first step's learning rate is 0 (warm-up): the third step sees the second's update
    assert plain[1]["lr"] > 0 and plain[2]["lm_loss"] < plain[0]["lm_loss"]
    return plain, overlapped


@pytest.mark.heavy
def test_ep_overlap_trains_bit_for_bit_as_the_plain_schedule(tmp_path):
    plain, overlapped = _plain_and_overlapped(tmp_path, mtp_steps=1)
    for a, b in zip(plain, overlapped):
        for key in (*KEYS, "mtp_1_loss"):
            assert b[key] == a[key], (a["step"], key, a[key], b[key])


@pytest.mark.heavy
def test_ep_overlap_with_the_shared_mtp_module_at_three_depths(tmp_path):
    """The plain backward sums the shared MTP layer's three depth gradients in its bf16 ``.grad``
    before megatron adds them to the fp32 main grad; the plan's per-depth nodes each run a
    backward of their own, so each depth's gradient is added in fp32. The first step's forward
    is the same computation (equal losses); its grad norm differs at ~1e-6 relative; Adam turns
    that into bf16 weights a few ulps apart, which move the third step's losses by ~1e-5."""
    plain, overlapped = _plain_and_overlapped(tmp_path, mtp_steps=3)
    depths = ["mtp_1_loss", "mtp_2_loss", "mtp_3_loss"]
    for key in ("lm_loss", "loss", *depths):
        assert overlapped[0][key] == plain[0][key], (key, plain[0][key], overlapped[0][key])
    for a, b in zip(plain[:2], overlapped[:2]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])
    for key in ("lm_loss", "loss", *depths):
        assert overlapped[2][key] == pytest.approx(plain[2][key], rel=3e-5), (key, plain[2][key], overlapped[2][key])
