"""All-gather context parallelism for MLA + DSA through the real training entry point: the tiny
GLM-5 at sequence 1024 (fp32, 5 steps, one initial checkpoint written at one rank) gives the same
per-step losses under CP2 and CP2 x TP2 (+SP) as on one rank, in dense, warm-up and sparse DSA
modes and on the packed long-context mixture (document masks, position resets) with YaRN RoPE.

Two layers (one dense-FFN, one MoE, both with DSA), one sequence per step and 256-query DSA chunks
keep the 10 launches within the 2-core CI budget; every code path of the full tiny model runs."""

import pytest

from tests.launch import initial_checkpoint, read_metrics, run_train

STEPS = 5
SEQ = 1024
REL_TOL = 1e-5
MODEL = "model.num_layers=2"
PACKED_YARN_SPARSE = ["model.dsa.mode=sparse", "data.mixture=long_context", "model.rope_type=yarn",
                      "model.yarn.factor=4", "model.yarn.original_max_position_embeddings=256"]
CASES = {  # name: (nproc, overrides)
    "dense_cp2": (2, ["parallel=cp2", "model.dsa.mode=dense"]),
    "warmup_cp2": (2, ["parallel=cp2", "model.dsa.mode=warmup"]),
    "sparse_cp2": (2, ["parallel=cp2", "model.dsa.mode=sparse"]),
    # packed documents, with YaRN past its original context (MLA's rotary sliced per CP rank, the
    # indexer's at the queries' global positions)
    "packed_yarn_sparse_cp2": (2, ["parallel=cp2", *PACKED_YARN_SPARSE]),
    "packed_yarn_sparse_cp2_tp2": (4, ["parallel=cp2_tp2", *PACKED_YARN_SPARSE]),
}


_REFERENCES: dict = {}


def _one_rank(root, ckpt, single) -> list:
    """One rank's metrics for these overrides (shared by the cases that need the same run)."""
    key = tuple(single)
    if key not in _REFERENCES:
        run_dir = root / f"one_{len(_REFERENCES)}"
        run_train(_common(ckpt, run_dir) + single)
        _REFERENCES[key] = read_metrics(str(run_dir))
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def init_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    return root, initial_checkpoint(root, MODEL)


def _common(ckpt, run_dir):
    return [f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}", f"trainer.seq_length={SEQ}",
            "trainer.global_batch_size=1", "trainer.micro_batch_size=1", MODEL, "model.dsa.query_chunk=256",
            "model.dsa.topk=128",
            # the CP runs are on the strict emulation's tracked device, where DSA takes the torch
            # path: so does the one-rank reference, and the comparison is about CP alone (the
            # fused CPU kernel against the torch path: tests/unit/test_dsa_cpu_kernel.py); top-k's
            # near-tie flips amplified the kernels' last-bit differences past the tolerances
            "model.dsa.kernels=torch",
            f"checkpoint.init_from={ckpt}", "checkpoint.save_at_end=false"]


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_losses_match_one_rank(init_checkpoint, case):
    root, ckpt = init_checkpoint
    nproc, overrides = CASES[case]
    single = [o for o in overrides if not o.startswith("parallel=")]
    ref = _one_rank(root, ckpt, single)
    summary = run_train(_common(ckpt, root / case) + overrides + ["parallel.cpu_emulation=strict"],
                        nproc=nproc)
    assert summary["world_size"] == nproc and summary["steps"] == STEPS
    got = read_metrics(str(root / case))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    keys = ["lm_loss", "mtp_loss", "loss", "grad_norm"]
    sparse = "mode=sparse" in " ".join(overrides)
    if "mode=dense" not in " ".join(overrides):
        keys.append("indexer_kl")
        assert all(r["indexer_kl"] > 0 for r in ref)
    for want, have in zip(ref, got):
        for key in keys:
            # Losses: 1e-5 at every step and mode (seen <= 1.6e-6: fp32 summation order only).
            # In sparse mode top-k is discontinuous: from step 2 on a last-bit difference in an
            # indexer score (CP computes each token's indexer key on its own rank, TP sums
            # partial projections) can swap a near-tied key in or out. The LM loss barely moves,
            # but the indexer KL does: it is ~5e-4, a difference of O(1) sums over the selected
            # keys (seen 1.4e-3 at step 5 of CP2 x TP2), and so does the grad norm (seen 3.6e-5;
            # 1.9e-4 in a packed step whose 2 sequences are all masked tool output, where only
            # the KL and MoE aux losses -- and so `loss` -- remain).
            rel = REL_TOL
            aux_only = want["loss_tokens"] == 0
            if sparse and want["step"] > 1:
                if key == "indexer_kl" or (key == "loss" and aux_only):
                    rel = 5e-3
                elif key == "grad_norm":
                    rel = 5e-4 if aux_only else 1e-4
            tol = dict(rel=rel, abs=1e-8 if key == "indexer_kl" else 0)
            assert have[key] == pytest.approx(want[key], **tol), (case, want["step"], key)
    moved = "indexer_kl" if "mode=warmup" in " ".join(overrides) else "lm_loss"
    # it trained (parity of a frozen model proves little); a packed step may hold only masked
    # tool output (no loss tokens, lm_loss 0): compare the steps that have some
    scored = [r for r in ref if moved == "indexer_kl" or r["loss_tokens"] > 0]
    assert len(scored) >= 2 and scored[-1][moved] < scored[0][moved]
