"""Data on several gloo ranks: rank 0 preprocesses missing corpora while the others wait, every
rank then builds the same blended samples; a preprocessing error reaches every rank (no hang);
a 2-rank training run logs cumulative consumed tokens per category."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from tests.support.launch import read_metrics, run_in_new_processes
from tests.support.data import corpus_cfg, tokenizer_path, write_jsonl


def _worker(rank: int, world: int, init_file: str, good: dict, bad: dict, run_dir: str, results):
    from data_pipeline.build import build_train_dataset
    from data_pipeline.config import DataConfig

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), good))
        ds = build_train_dataset(cfg, 64, 7, run_dir, 512, num_samples=32)
        digest = hashlib.sha256(torch.stack([ds[i]["tokens"] for i in range(32)]).numpy().tobytes()).hexdigest()
        outcome = {"digest": digest}
        try:
            build_train_dataset(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), bad)),
                                64, 7, run_dir, 512, num_samples=32)
        except Exception as e:  # noqa: BLE001  (the test checks what each rank saw)
            outcome["error"] = f"{type(e).__name__}: {e}"
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
@pytest.mark.all_cores  # two spawned ranks
def test_rank0_preprocesses_others_wait_and_errors_reach_all(tmp_path):
    f = write_jsonl(tmp_path / "good.jsonl", [{"text": f"sample text number {i} " * 5} for i in range(200)])
    b = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}] * 20 + [{"content": "no text"}])
    good = OmegaConf.to_container(OmegaConf.structured(corpus_cfg(tmp_path / "cache", [f])))
    bad = OmegaConf.to_container(OmegaConf.structured(corpus_cfg(tmp_path / "cache", [b])))
    tokenizer_path()  # the shared tokenizer exists before the ranks start
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "pg"), good, bad, str(tmp_path / "run"), results), nprocs=2)
    assert results[0]["digest"] == results[1]["digest"]
    for r in (0, 1):
        assert results[r]["error"].startswith("DataError: corpus 'c': ") and "no field 'text'" in results[r]["error"]
    assert len(os.listdir(tmp_path / "cache" / "indexed")) == 2  # the good corpus and .locks only


@pytest.mark.heavy
def test_two_rank_run_logs_tokens_per_category(tmp_path):
    prose = write_jsonl(tmp_path / "p.jsonl", [{"text": f"Paragraph {i}. " + "The data is mixed. " * 9} for i in range(300)])
    code = write_jsonl(tmp_path / "c.jsonl", [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(300)])
    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True)
    (conf / "mini.yaml").write_text(
        f"cache_dir: {tmp_path / 'cache'}\ntokenizer: {{path: {tokenizer_path()}}}\ncorpora:\n"
        f"  prose: {{category: general, paths: [{prose}]}}\n  code: {{category: code, paths: [{code}]}}\n"
        "mixtures:\n  default: {prose: 0.75, code: 0.25}\n")
    run_dir = tmp_path / "run"
    summary = run_in_new_processes(
        [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=mini", "parallel=dp2_distopt", "trainer.steps=2",
         "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.seq_length=64",
         f"trainer.run_dir={run_dir}", "checkpoint.save_at_end=false"], nproc=2)
    assert summary["steps"] == 2 and summary["world_size"] == 2
    for rank in (0, 1):  # megatron's chatter of each rank, from its import on, is in its own file
        # (pretrain.reporting.logs); hence processes of this run's own: a rank pool imported it earlier
        assert "megatron.core" in (run_dir / "logs" / f"rank{rank}.log").read_text()
    metrics = read_metrics(str(run_dir))
    for step, rec in enumerate(metrics, start=1):
        assert rec["tokens_general"] + rec["tokens_code"] == rec["consumed_tokens"] == step * 8 * 64
    assert metrics[-1]["tokens_general"] == 12 * 64 and metrics[-1]["tokens_code"] == 4 * 64
