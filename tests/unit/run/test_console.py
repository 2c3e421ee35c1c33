"""The run's console: library logs routed to <run_dir>/logs (pretrain.reporting.logs), the banner's
parameter counts (model_providers.glm5.counting.size) and its lines (pretrain.reporting.console)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import warnings

import pytest
from omegaconf import OmegaConf

from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
from pretrain.reporting import console
from pretrain.reporting import logs
from model_providers.glm5.counting.size import human, model_size

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf")
BUCKET = "Params for bucket 1 (1378528 elements, 1378528 padded size):"


@pytest.fixture
def routing():
    made = []

    def make(verbose):
        made.append(logs.route(verbose))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _library_chatter():
    logging.getLogger("megatron.core.distributed.param_and_grad_buffer").info(BUCKET)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "megatron/core/models/backends.py", 21)


def test_library_logs_go_to_the_rank_file_and_ours_stay_on_the_console(routing, tmp_path, capsys):
    r = routing(verbose=False)
    _library_chatter()  # before the run dir exists: held, then written to the file
    path = r.to_file(str(tmp_path), rank=0)
    logging.getLogger("checkpointing.state").warning("checkpoint fallback to iter_0000002")
    logging.getLogger("pretrain.stage").info("our own info line")
    logging.getLogger("megatron.core.optimizer").error("a library error")
    err = capsys.readouterr().err
    assert BUCKET not in err and "Apex" not in err
    assert "warning: checkpoint fallback to iter_0000002" in err
    assert "our own info line" in err and "error: a library error" in err
    r.close()
    assert path == str(tmp_path / "logs" / "rank0.log")
    text = open(path).read()
    for line in (BUCKET, "UserWarning: Apex is not installed", "checkpoint fallback", "a library error"):
        assert line in text, line
    assert text.index(BUCKET) < text.index("checkpoint fallback")  # held records come first


def test_verbose_brings_library_logs_back_to_the_console(routing, tmp_path, capsys):
    r = routing(verbose=True)
    r.to_file(str(tmp_path), rank=0)
    _library_chatter()
    err = capsys.readouterr().err
    assert BUCKET in err and "UserWarning: Apex is not installed" in err
    r.close()
    assert BUCKET in (tmp_path / "logs" / "rank0.log").read_text()


def test_other_ranks_print_only_errors(routing, tmp_path, capsys):
    r = routing(verbose=False)
    r.to_file(str(tmp_path), rank=1)
    logging.getLogger("checkpointing.state").warning("rank 1 warning")
    logging.getLogger("pretrain.stage").error("rank 1 error")
    err = capsys.readouterr().err
    assert "rank 1 warning" not in err and "error: rank 1 error" in err
    r.close()
    assert "rank 1 warning" in (tmp_path / "logs" / "rank1.log").read_text()


def test_close_restores_the_root_logger(tmp_path):
    root = logging.getLogger()
    before = (list(root.handlers), root.level, warnings.showwarning)
    r = logs.route(verbose=False)
    r.to_file(str(tmp_path), rank=0)
    assert root.handlers != before[0]
    r.close()
    assert (list(root.handlers), root.level, warnings.showwarning) == before


def test_child_processes_write_to_the_log_file_inside_the_block(routing, tmp_path, capfd):
    """datatrove's workers inherit fd 2; our console handler keeps the real stderr meanwhile."""
    r = routing(verbose=False)
    path = r.to_file(str(tmp_path), rank=0)
    with logs.children_to_file():
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('worker banner\\n')"], check=True)
        logging.getLogger("megatron.core").error("an error inside the block")
    subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('after the block\\n')"], check=True)
    err = capfd.readouterr().err
    assert "worker banner" not in err and "error: an error inside the block" in err
    assert "after the block" in err
    assert "worker banner" in open(path).read()


def test_an_exception_inside_the_block_restores_stderr(routing, tmp_path, capfd):
    r = routing(verbose=False)
    r.to_file(str(tmp_path), rank=0)
    with pytest.raises(RuntimeError, match="preprocessing failed"):
        with logs.children_to_file():
            raise RuntimeError("preprocessing failed")
    os.write(2, b"stderr is back\n")
    assert "stderr is back" in capfd.readouterr().err


# --- parameter counts ---------------------------------------------------------------------------


def _yaml_model(name: str) -> GLM5Config:
    yaml = OmegaConf.load(os.path.join(CONF, "model", f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), yaml))


def test_744b_counts_match_the_hf_dump():
    """HF stores 753,864,139,008 parameters (docs/model.md), of which the 76 routers'
    expert biases (76 x 256) are megatron buffers; 744B without the MTP module; ~39.9B active
    per token without embeddings."""
    size = model_size(_yaml_model("glm5_744b"))
    assert size.total == 753_864_139_008 - 76 * 256
    assert human(size.total - size.mtp) == "743.9B" and human(size.active) == "39.88B"


@pytest.mark.parametrize("change", [{}, {"vocab_size": 300, "mtp_num_steps": 0},
                                    {"num_experts": None, "first_k_dense": 0, "mtp_num_steps": 2}])
def test_counts_equal_the_built_model(one_rank, change):
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig

    cfg = dataclasses.replace(GLM5Config(), **change)
    (model,) = build_model_chunks(cfg, to_transformer_config(cfg, ParallelConfig(), PrecisionConfig()), "local")
    params = dict(model.named_parameters())
    size = model_size(cfg)
    assert size.total == sum(p.numel() for p in params.values())
    assert size.mtp == sum(p.numel() for n, p in params.items() if n.startswith("mtp."))
    experts = [p.numel() for n, p in params.items() if ".local_experts." in n and not n.startswith("mtp.")]
    unused = sum(experts) * (cfg.num_experts - cfg.moe_topk) // cfg.num_experts if cfg.num_experts else 0
    embeddings = sum(params[n].numel() for n in ("embedding.word_embeddings.weight", "output_layer.weight"))
    assert size.active == size.total - size.mtp - embeddings - unused


# --- console lines ------------------------------------------------------------------------------


def test_banner_of_the_default_curriculum():
    from pretrain.config.schema import compose, to_run_config
    from pretrain.config.validation import plan_run

    rc = to_run_config(compose([]))
    stages = plan_run(rc, 1)
    lines = console.banner(rc, stages, 1, "local", "/r", "/r/logs/rank0.log", "offline: /r/wandb/x", "fresh")
    text = "\n".join(lines)
    assert "params   1.44M (1.13M + 313.6K MTP); 555.8K active per token" in text
    assert "world 1 = dp 1 x tp 1 x pp 1 x cp 1" in text and "offline: /r/wandb/x" in text
    rows = {ln.split()[0]: ln.split() for ln in lines[-len(stages):]}
    assert list(rows) == [st.name for st in stages] and len(stages) == 7
    for st in stages:
        assert rows[st.name][1:3] == [str(st.steps), f"{st.steps * st.tokens_per_step:,}"]
    assert f"stages   7 ({sum(st.steps for st in stages)} steps" in text


def test_step_line_names_the_key_metrics():
    rec = {"step": 42, "stage": "dsa_warmup", "loss": 4.25, "lm_loss": 3.5, "mtp_loss": 3.75,
           "mtp_1_loss": 3.7, "indexer_kl": 0.125, "lr": 2e-4, "grad_norm": 0.5, "tokens_per_s": 12345.6}
    line = console.step_line(rec)
    for part in ("step    42", "dsa_warmup", "loss 4.2500", "lm 3.5000", "mtp 3.7500", "kl 0.1250",
                 "lr 2.00e-04", "gnorm 0.500", "12,346 tok/s"):
        assert part in line, part
    assert "SKIPPED" not in line and "SKIPPED" in console.step_line({**rec, "skipped": True})
    del rec["mtp_1_loss"], rec["indexer_kl"]  # no MTP module, no DSA indexer loss
    assert "mtp" not in console.step_line(rec) and "kl" not in console.step_line(rec)
