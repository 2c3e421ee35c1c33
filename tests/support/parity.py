"""The one parity harness: a run under a parallel layout against the same run on one rank.

A case is one :class:`Row` (layout x optimizer x DSA mode x model shape). Every row of a shape
starts from one checkpoint written by one rank (megatron's seeding makes fresh weights depend on
the layout; loading it with resharding also exercises dist_checkpointing), and every row with the
same optimizer, DSA mode and extra overrides is compared with one shared one-rank reference run.
The layout runs under the strict CUDA emulation, so a host tensor where a GPU run needs a device
one fails here too.

How two runs are compared: first the keys each sparse DSA query selected (:mod:`.topk_digest`),
step by step; then every metric of each step whose selections are the same, at one fp32
tolerance. Top-k is discontinuous: once a layout's summation order moves an indexer score across
a near-tie, that step trains on other keys and every later step legitimately differs, so the
comparison ends at the first step (after the first) whose selections differ.
Dense and warm-up runs select nothing and are compared at every step.

The tolerance: each metric is an fp32 reduction over ~1e5 terms whose order the layout changes
(TP splits the GEMMs' inner sums, CP and DP the loss sums, EP the expert sums): the rounding is
O(sqrt(n) u) ~ 1e-5 relative at worst for u = 6e-8, and the 5 steps' updates carry it along at
the same order. The indexer KL (~1e-3) is a difference of O(1) sums: the same absolute rounding
(~1e-8) is a larger part of it, hence its absolute term.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.support.launch import initial_checkpoint, read_metrics, run_train
from tests.support import topk_digest

STEPS = 5
REL = 1e-5
KL_ABS = 1e-8
MUON = ("optimizer=muon_split", "optimizer.lr=0.003", "optimizer.min_lr=0.0003",
        "optimizer.muon.lr=0.003", "optimizer.muon.min_lr=0.0003")
#: model shapes: the tiny GLM-5 as configured, the tiny DeepSeek-V3 (no DSA indexer), and two of
#: the tiny GLM-5's layers at 1024 tokens for context parallelism (one dense-FFN and one MoE layer,
#: both with DSA; one sequence per step; the DSA runs on the torch path in both runs: under the
#: strict emulation's tracked device the fused CPU kernel does not run, and the comparison is
#: about the layout alone)
SHAPES = {
    "tiny": (),
    "deepseek_v3_tiny": ("model=deepseek_v3_tiny",),
    "long": ("model.num_layers=2", "trainer.seq_length=1024", "trainer.global_batch_size=1",
             "trainer.micro_batch_size=1", "model.dsa.query_chunk=256", "model.dsa.topk=128",
             "model.dsa.kernels=torch"),
}


@dataclass(frozen=True)
class Row:
    name: str
    nproc: int
    layout: tuple  #: the overrides that make the layout (the reference runs without them)
    optimizer: str = "adam"  #: adam | muon_split
    dsa_mode: str = "dense"
    shape: str = "tiny"
    extra: tuple = ()  #: overrides both runs take (data mixture, RoPE, kernels)
    memory_as_planned: bool = True  #: each rank's measured state bytes equal the planner's

    def shared(self) -> tuple:
        """Overrides the reference run has too."""
        return (*SHAPES[self.shape], *(MUON if self.optimizer == "muon_split" else ()),
                f"model.dsa.mode={self.dsa_mode}", *self.extra)


class Harness:
    """Initial checkpoints and one-rank references, made on first use and shared by every row
    (one per pytest session: see the ``parity`` fixture)."""

    def __init__(self, root):
        self.root = root
        self._checkpoints: dict = {}
        self._references: dict = {}

    def checkpoint(self, shape: str):
        if shape not in self._checkpoints:
            self._checkpoints[shape] = initial_checkpoint(self.root / f"init_{shape}", *SHAPES[shape])
        return self._checkpoints[shape]

    def run(self, run_dir, shape: str, overrides, nproc: int = 1) -> tuple[list, dict]:
        """(metrics, top-k digests) of a run of ``STEPS`` steps from the shape's checkpoint."""
        digests = run_dir / "topk"
        common = [f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}",
                  f"checkpoint.init_from={self.checkpoint(shape)}", "checkpoint.save_at_end=false"]
        summary = run_train([*common, *overrides], nproc=nproc, digest_dir=digests)
        assert summary["world_size"] == nproc and summary["steps"] == STEPS, summary
        metrics = read_metrics(str(run_dir))
        assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
        return metrics, topk_digest.read(digests) if digests.exists() else {}

    def reference(self, row: Row) -> tuple[list, dict]:
        key = row.shared()
        if key not in self._references:
            run_dir = self.root / f"one_rank_{len(self._references)}"
            self._references[key] = (*self.run(run_dir, row.shape, list(key)), run_dir)
        metrics, digests, _ = self._references[key]
        return metrics, digests

    def reference_dir(self, row: Row):
        self.reference(row)
        return self._references[row.shared()][2]

    def check(self, row: Row) -> None:
        want, want_topk = self.reference(row)
        run_dir = self.root / row.name
        have, have_topk = self.run(run_dir, row.shape,
                                   [*row.shared(), *row.layout, "parallel.cpu_emulation=strict"], row.nproc)
        compared = assert_same_training(want, have, want_topk, have_topk, row.dsa_mode)
        if row.dsa_mode != "sparse":
            assert compared == STEPS
        assert_it_trained(want, row.dsa_mode)
        if row.memory_as_planned:
            assert_memory_as_planned(run_dir)


def assert_same_training(want: list, have: list, want_topk: dict, have_topk: dict, dsa_mode: str) -> int:
    """Each step's selections, then its metrics at :data:`REL`, until the first step after the
    first whose selections differ; returns how many steps were compared (>= 1). The first step is
    always compared: both runs start from the same weights, so a selection can differ there only
    by a near-tie the layout's summation order moved (seen: one row of 4,480 under CP2 x TP2,
    which moved the step's loss by 2.7e-6)."""
    keys = ["lm_loss", "mtp_loss", "loss", "grad_norm"] + (["indexer_kl"] if dsa_mode not in ("dense", "none") else [])
    keys += sorted(k for k in want[0] if k.startswith("mtp_") and k[4:-5].isdigit())  # each MTP depth's loss
    if dsa_mode == "sparse":  # both runs recorded every step's selections
        assert set(want_topk) == set(have_topk) == {r["step"] for r in want}, (sorted(want_topk), sorted(have_topk))
    compared = 0
    for a, b in zip(want, have):
        step = a["step"]
        picked_a, picked_b = want_topk.get(step, frozenset()), have_topk.get(step, frozenset())
        if picked_a != picked_b and compared > 0:
            break
        for key in keys:
            tol = dict(rel=REL, abs=KL_ABS if key == "indexer_kl" else 0)
            assert b[key] == pytest.approx(a[key], **tol), (step, key, a[key], b[key])
        compared += 1
    return compared


def assert_it_trained(metrics: list, dsa_mode: str) -> None:
    """Parity of a model that does not train would prove little: the LM loss fell (the indexer
    KL in warm-up), over the steps that have loss tokens (a packed step may hold only masked tool
    output)."""
    key = "indexer_kl" if dsa_mode == "warmup" else "lm_loss"
    scored = [r for r in metrics if key == "indexer_kl" or r["loss_tokens"] > 0]
    assert len(scored) >= 2 and scored[-1][key] < scored[0][key], [r[key] for r in metrics]


def assert_memory_as_planned(run_dir) -> None:
    """Each rank's weights, grads, main params and optimizer state, measured after its first step
    (memory/rank<N>.json), are the planner's numbers for its pipeline and data-parallel ranks."""
    from planner.memory import compare_with_run

    rows = compare_with_run(str(run_dir))
    assert rows and all(r["predicted"] == r["measured"] for r in rows), [
        r for r in rows if r["predicted"] != r["measured"]]
