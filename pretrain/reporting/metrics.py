"""Where step metrics go: a rich progress bar (on a terminal only: piped to a file it would be
noise), a console line every N steps (pretrain.reporting.console), metrics.jsonl and W&B (online /
offline / disabled). Only global rank 0 writes; the loop hands it reduced values."""

from __future__ import annotations

import json
import os
from typing import Optional

from pretrain.reporting import console
from pretrain.config.schema import LoggerConfig


class MetricsSink:
    def __init__(self, cfg: LoggerConfig, run_dir: str, total_steps: int, start_step: int,
                 run_name: str, config_dict: dict, wandb_run_id: Optional[str], rank: int):
        self.cfg = cfg
        self.active = rank == 0
        self.wandb_run = None
        self.progress = None
        self.wandb_run_id = wandb_run_id
        if not self.active:
            return
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if cfg.wandb.mode != "disabled":
            id_file = os.path.join(run_dir, "wandb", RUN_ID_FILE)
            run_id = _read_run_id(id_file) or wandb_run_id
            self.wandb_run = _start_wandb(cfg, run_dir, run_name, config_dict, run_id)
            self.wandb_run_id = self.wandb_run.id
            _write_run_id(id_file, self.wandb_run_id)
        if cfg.progress_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=True,
            )
            if progress.console.is_terminal:
                self.progress = progress
                self.task = progress.add_task("train", total=total_steps, completed=start_step, status="")
                progress.start()

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])
            except Exception as e:  # e.g. a job-wide SIGTERM also ended the wandb-core service
                self._drop_wandb(e)
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=f"loss {record['loss']:.3f}")
        if record["step"] % self.cfg.log_every == 0 or record.get("skipped"):
            console.say(console.step_line(record))
        if "valid_lm_loss" in record:
            console.say(console.validation_line(record) + category_losses(record))

    def event(self, line: str) -> None:
        """A stage start, a checkpoint: one console line from rank 0."""
        if self.active:
            console.say(line)

    @property
    def wandb_where(self) -> str:
        """The W&B run's URL (online), its local folder (offline), or why there is none."""
        if self.wandb_run is None:
            return "disabled" if self.cfg.wandb.mode == "disabled" else "stopped"
        if self.cfg.wandb.mode == "offline":
            return f"offline: {self.wandb_run.settings.sync_dir} (wandb sync it to upload)"
        return self.wandb_run.url

    def close(self) -> None:
        if not self.active:
            return
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as e:
                self._drop_wandb(e)

    def _drop_wandb(self, error: Exception) -> None:
        """W&B is a mirror of metrics.jsonl: losing it must not stop the run (or its last save)."""
        import logging

        logging.getLogger(__name__).warning("W&B logging stopped (%s: %s); metrics.jsonl continues",
                                            error.__class__.__name__, error)
        self.wandb_run = None


def category_losses(record: dict) -> str:
    """`` | code 2.9812 math 2.1043 ...``: the record's ``valid_lm_loss/<category>`` values."""
    parts = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in sorted(record.items()) if k.startswith("valid_lm_loss/")]
    return " | " + " ".join(parts) if parts else ""


#: ``<run_dir>/wandb/run_id``: written when the W&B run starts, so a job that is requeued or
#: restarted before its first checkpoint still appends to the same run
RUN_ID_FILE = "run_id"


def _read_run_id(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _write_run_id(path: str, run_id: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(run_id)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _start_wandb(cfg: LoggerConfig, run_dir: str, run_name: str, config_dict: dict,
                 run_id: Optional[str]):
    import wandb

    return wandb.init(
        mode=cfg.wandb.mode,
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        name=cfg.wandb.name or run_name,
        group=cfg.wandb.group,
        tags=list(cfg.wandb.tags),
        dir=run_dir,
        config=config_dict,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )

