"""The default run (what `make run` does, with only the run dir moved to a temp folder): the
tiny GLM-5 curriculum on CPU -- general then code/reasoning-heavy pretraining at 128 tokens,
context extension to 256 / 512 / 1024, DSA indexer warm-up, sparse training -- leaving the run
directory of docs/design.md, the curriculum plot and a one-line JSON summary. (How long it takes
is not a test's to judge: speed claims live in benchmarks/.)"""

import json
import os
import subprocess

import pytest
import torch
import yaml

from pretrain.reporting.logs import OWN_PACKAGES
from tests.support.launch import REPO, checkpoint_tensors, read_metrics, train_env

STAGES = [  # name, steps, sequence length, mixture
    ("pretrain_general", 16, 128, "default"),
    ("pretrain_code_reasoning", 10, 128, "code_reasoning"),
    ("extend_256", 6, 256, "default"),
    ("extend_512", 4, 512, "long_context"),
    ("extend_1024", 4, 1024, "long_context"),
    ("dsa_warmup", 8, 1024, "long_context"),
    ("dsa_sparse", 6, 1024, "long_context"),
]


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("default") / "run"
    proc = subprocess.run(
        [os.path.join(REPO, ".venv", "bin", "python"), "-m", "pretrain.train", f"trainer.run_dir={run_dir}"],
        cwd=REPO, env=train_env(1), capture_output=True, text=True, timeout=900,
    )
    (run_dir.parent / "console.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_default_run_goes_through_every_stage(default_run):
    run_dir, summary = default_run
    for key in ("run_dir", "steps", "consumed_tokens", "initial_loss", "final_loss", "stages"):
        assert key in summary
    assert [(s["name"], s["steps"], s["seq_length"]) for s in summary["stages"]] == [
        (n, k, L) for n, k, L, _ in STAGES]
    assert summary["steps"] == sum(k for _, k, _, _ in STAGES)

    metrics = read_metrics(str(run_dir))
    assert [r["step"] for r in metrics] == list(range(1, summary["steps"] + 1))
    for key in ("step", "stage", "consumed_tokens", "loss", "lm_loss", "mtp_loss", "lr",
                "grad_norm", "tokens_per_s", "tflops_per_s", "moe_load_imbalance", "seq_length",
                "mixture", "tokens_code", "tokens_agent"):
        assert key in metrics[0], key
    # sequence length, batch and mixture switch exactly at the stage boundaries
    first = 0
    for name, steps, seq, mixture in STAGES:
        rows = metrics[first:first + steps]
        assert {(r["stage"], r["seq_length"], r["mixture"]) for r in rows} == {(name, seq, mixture)}
        assert sum(s["tokens"] for s in summary["stages"] if s["name"] == name) == sum(
            r["global_batch_size"] * r["seq_length"] for r in rows)
        first += steps
    assert metrics[-1]["consumed_tokens"] == summary["consumed_tokens"]
    # the code/reasoning-heavy mixture really delivers more code + math per token
    by = {n: [r for r in metrics if r["stage"] == n] for n, *_ in STAGES}

    def share(name):
        before = metrics[metrics.index(by[name][0]) - 1] if metrics.index(by[name][0]) else None
        got = {c: by[name][-1][f"tokens_{c}"] - (before[f"tokens_{c}"] if before else 0)
               for c in ("general", "code", "math", "agent")}
        return (got["code"] + got["math"]) / sum(got.values())
    assert share("pretrain_code_reasoning") > share("pretrain_general") + 0.15


@pytest.mark.heavy
def test_default_run_learns_and_the_lr_follows_each_stage(default_run):
    run_dir, summary = default_run
    metrics = read_metrics(str(run_dir))
    by = {n: [r for r in metrics if r["stage"] == n] for n, *_ in STAGES}
    pre = by["pretrain_general"] + by["pretrain_code_reasoning"]
    assert _mean([r["lm_loss"] for r in pre[-4:]]) < _mean([r["lm_loss"] for r in pre[:4]]) - 1.0
    # indexer KL falls during warm-up
    kl = [r["indexer_kl"] for r in by["dsa_warmup"]]
    assert _mean(kl[-3:]) < 0.8 * _mean(kl[:3]), kl
    # sparse attention keeps the validation LM loss of the dense model it starts from (< 10% up)
    warm_valid = by["dsa_warmup"][-1]["valid_lm_loss"]
    sparse_valid = [r["valid_lm_loss"] for r in by["dsa_sparse"] if "valid_lm_loss" in r]
    assert len(sparse_valid) == 2 and max(sparse_valid) < 1.10 * warm_valid, (warm_valid, sparse_valid)
    # every stage's first step runs at the LR its config names (no silent reset to warm-up)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())["curriculum"]["stages"]
    for stage in cfg:
        rows = by[stage["name"]]
        lr = stage["lr"]
        assert rows[0]["lr"] == pytest.approx(lr["init"] if lr["warmup_steps"] else lr["peak"]), stage["name"]
        if lr["style"] == "linear":
            n = len(rows)
            assert rows[-1]["lr"] == pytest.approx(lr["peak"] + (lr["end"] - lr["peak"]) * (n - 1) / n)
    assert by["dsa_sparse"][-1]["lr"] == 1.5e-4


@pytest.mark.heavy
def test_warmup_trains_only_the_indexer_and_sparse_trains_everything(default_run, tmp_path):
    run_dir, _ = default_run
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000054"
    assert not list(ckpts.glob("*.tmp"))
    before = checkpoint_tensors(ckpts / "iter_0000040", tmp_path)  # end of extend_1024
    warm = checkpoint_tensors(ckpts / "iter_0000048", tmp_path)  # end of dsa_warmup
    sparse = checkpoint_tensors(ckpts / "iter_0000054", tmp_path)  # end of dsa_sparse
    weights = [k for k in before if not k.startswith("optimizer.") and "_extra_state" not in k]
    indexer = [k for k in weights if ".indexer." in f".{k}"]
    others = [k for k in weights if k not in indexer]
    assert indexer and len(others) > 20
    for k in others:
        assert torch.equal(before[k], warm[k]), f"{k} changed during the indexer warm-up"
    for k in indexer:
        assert not torch.equal(before[k], warm[k]), f"{k} did not train during the warm-up"
    params = [k for k in weights if "expert_bias" not in k and "local_tokens_per_expert" not in k]
    unchanged = [k for k in params if torch.equal(warm[k], sparse[k])]
    assert not unchanged, f"sparse training left these unchanged: {unchanged}"


@pytest.mark.heavy
def test_default_run_leaves_the_run_directory(default_run):
    run_dir, summary = default_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["num_layers"] == 4 and len(config["curriculum"]["stages"]) == 7
    assert (run_dir / "checkpoints" / "iter_0000054" / "metadata.json").exists()
    png = run_dir / "curriculum.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, "one W&B offline run for the whole curriculum"


@pytest.mark.heavy
def test_default_run_console_is_ours_and_the_libraries_go_to_the_log(default_run):
    """<= 80 lines on stdout + stderr: banner, stage / step / validation / checkpoint lines and the
    summary; megatron's chatter (a DDP bucket's parameter list per stage, ...) is in the log."""
    run_dir, summary = default_run
    console = (run_dir.parent / "console.txt").read_text().splitlines()
    assert len(console) <= 80, "\n".join(console)
    text = "\n".join(console)
    for line in ("GLM-5 pretraining: glm5-tiny", "params   1.44M", f"run dir  {run_dir}",
                 f"logs     {run_dir / 'logs' / 'rank0.log'}", f"W&B      offline: {run_dir / 'wandb'}",
                 f"done: {summary['steps']} steps"):
        assert line in text, line
    for i, (name, steps, seq, mixture) in enumerate(STAGES):
        assert f"== stage {i + 1}/7 {name}: {steps} steps" in text, name
        assert sum(ln.split()[:2] == [name, str(steps)] for ln in console) == 2  # banner, summary
    assert sum(ln.startswith("checkpoint ") for ln in console) == len(STAGES)
    assert sum(ln.startswith("valid ") for ln in console) == 3  # dsa_warmup's end, dsa_sparse x 2
    assert sum(ln.startswith("step ") for ln in console) == summary["steps"] // 10
    # the libraries' records are in the log, none of them on the console: every log record names
    # its logger (FILE_FORMAT); megatron's, one DDP build per stage at least, stayed off stdout/stderr
    records = [line.split(" ", 4) for line in (run_dir / "logs" / "rank0.log").read_text().splitlines()
               if line[:2] == "20" and len(line.split(" ", 4)) == 5]
    library = [(name.rstrip(":"), message) for _, _, _, name, message in records
               if name.split(".")[0].rstrip(":") not in OWN_PACKAGES]
    megatron = [m for n, m in library if n.startswith("megatron.")]
    assert len(megatron) >= len(STAGES), library[:5]
    assert not [m for _, m in library if len(m) >= 20 and m in text]
