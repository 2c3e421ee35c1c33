"""Curricula through the real entry point: a run killed inside its third stage and restarted
writes exactly the metrics of an uninterrupted run; a stage that changes the parallel layout
(DP2 -> TP2+SP on the same 2 ranks) continues with the weights and gives one rank's losses;
``curriculum.only`` runs one stage per job and the chain equals one job."""

import json

import pytest

from tests.support.launch import kill_after_checkpoint, read_metrics, run_train

TIMING = ("step_time_s", "tokens_per_s", "tflops_per_s")

THREE_STAGES = """
stages:
  - {name: short, steps: 2, seq_length: 64, global_batch_size: 4, micro_batch_size: 2,
     lr: {init: 0.0, peak: 2.0e-3, end: 1.0e-3, warmup_steps: 1, style: cosine}, dsa_mode: dense}
  - {name: longer, steps: 2, seq_length: 128, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 1.0e-3, end: 5.0e-4, style: linear, warmup_steps: 0}}
  - {name: indexer_warmup, steps: 3, seq_length: 128, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 5.0e-3, end: 1.0e-3, style: linear, warmup_steps: 0}, dsa_mode: warmup, optimizer_state: reset}
start: null
only: null
plot: true
"""


@pytest.fixture(scope="module")
def conf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("conf")
    (root / "curriculum").mkdir()
    (root / "curriculum" / "three.yaml").write_text(THREE_STAGES)
    return root


def _overrides(conf_dir, run_dir, *extra):
    return [f"hydra.searchpath=[file://{conf_dir}]", "curriculum=three", f"trainer.run_dir={run_dir}",
            "model.dsa.topk=16", *extra]


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.heavy
def test_kill_inside_third_stage_and_resume_writes_the_same_metrics(conf_dir, tmp_path):
    straight = tmp_path / "straight"
    summary = run_train(_overrides(conf_dir, straight))
    assert [(s["name"], s["steps"]) for s in summary["stages"]] == [
        ("short", 2), ("longer", 2), ("indexer_warmup", 3)]
    assert (straight / "curriculum.png").stat().st_size > 10_000

    resumed = tmp_path / "resumed"
    overrides = _overrides(conf_dir, resumed, "checkpoint.save_every=1", "checkpoint.keep_last=1")
    kill_after_checkpoint(overrides, resumed / "checkpoints" / "latest",
                           "iter_0000006")
    killed = read_metrics(str(resumed))
    assert killed[-1]["stage"] == "indexer_warmup" and killed[-1]["stage_step"] == 2
    run_train(overrides)

    want, have = _strip(read_metrics(str(straight))), _strip(read_metrics(str(resumed)))
    assert [r["step"] for r in have] == list(range(1, 8))
    assert have == want  # every loss, LR, grad norm, token count and KL, bit for bit
    # stage-final checkpoints survive keep_last=1 retention; the rest is pruned
    ckpts = sorted(p.name for p in (resumed / "checkpoints").glob("iter_*"))
    assert ckpts == ["iter_0000002", "iter_0000004", "iter_0000007"]


@pytest.mark.heavy
def test_only_one_stage_per_job_equals_one_job(conf_dir, tmp_path):
    one_job = tmp_path / "one"
    run_train(_overrides(conf_dir, one_job))
    chained = tmp_path / "chained"
    for name in ("short", "longer", "indexer_warmup"):
        summary = run_train(_overrides(conf_dir, chained, f"curriculum.only={name}"))
        assert summary["stages"][-1]["name"] == name
    assert _strip(read_metrics(str(chained))) == _strip(read_metrics(str(one_job)))
    # a repeated job of a finished stage trains nothing
    again = run_train(_overrides(conf_dir, chained, "curriculum.only=longer"))
    assert again["steps"] == 7
    assert len(read_metrics(str(chained))) == 7


@pytest.mark.heavy
def test_stage_with_another_parallel_layout_continues_the_weights(conf_dir, tmp_path):
    two = ["curriculum.stages.2.steps=2"]
    one_rank = tmp_path / "one_rank"
    run_train(_overrides(conf_dir, one_rank, *two))
    switched = tmp_path / "switched"
    summary = run_train(_overrides(conf_dir, switched, *two, "+curriculum.stages.1.parallel.tp=2",
                                   "+curriculum.stages.1.parallel.sequence_parallel=true",
                                   "+curriculum.stages.2.parallel.tp=2",
                                   "+curriculum.stages.2.parallel.sequence_parallel=true",
                                   "parallel.cpu_emulation=strict"), nproc=2)
    assert summary["world_size"] == 2
    cfg = json.loads(json.dumps(summary))
    assert [s["steps"] for s in cfg["stages"]] == [2, 2, 2]
    want, have = read_metrics(str(one_rank)), read_metrics(str(switched))
    assert len(want) == len(have) == 6
    for a, b in zip(want, have):
        for key in ("lm_loss", "mtp_loss", "loss", "grad_norm", "lr", "consumed_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], a["stage"], key)


LONG_CP = """
stages:
  - {name: short, steps: 2, seq_length: 128, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 2.0e-3, end: 1.0e-3, style: linear, warmup_steps: 0}, dsa_mode: dense}
  - {name: long_cp2, steps: 2, seq_length: 4096, global_batch_size: 2, micro_batch_size: 1,
     lr: {peak: 1.0e-3, end: 5.0e-4, style: linear, warmup_steps: 0}, mixture: long_context, dsa_mode: sparse,
     optimizer_state: reset, parallel: {cp: 2}}
start: null
only: null
plot: false
"""


@pytest.mark.heavy
def test_tiny_stage_at_4096_tokens_with_cp2(conf_dir, tmp_path):
    """A curriculum stage that switches 2 ranks from DP2 to CP2 for 4096-token packed agent data
    with sparse DSA (top-k 64 of up to 4096 keys)."""
    (conf_dir / "curriculum" / "long_cp.yaml").write_text(LONG_CP)
    summary = run_train([f"hydra.searchpath=[file://{conf_dir}]", "curriculum=long_cp",
                         f"trainer.run_dir={tmp_path / 'run'}", "model.dsa.topk=64"], nproc=2)
    assert [(s["name"], s["steps"], s["seq_length"]) for s in summary["stages"]] == [
        ("short", 2, 128), ("long_cp2", 2, 4096)]
    rows = read_metrics(str(tmp_path / "run"))
    long = [r for r in rows if r["stage"] == "long_cp2"]
    assert all(r["loss_tokens"] > 0 and 0 < r["lm_loss"] < 10 and r["indexer_kl"] > 0 for r in long)
    assert long[-1]["consumed_tokens"] - rows[1]["consumed_tokens"] == 2 * 2 * 4096
