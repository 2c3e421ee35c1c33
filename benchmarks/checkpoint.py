"""Checkpoint saves and loads on gloo ranks: every save, the format before issue 38 against the one
after; ``--stage-end``: a stage's final save into another layout, gathered against per rank.

    .venv/bin/python benchmarks/checkpoint.py [--ranks 4] [--hidden 512] [--layers 6] [--repeats 3]
    .venv/bin/python benchmarks/checkpoint.py --stage-end [--ranks 4] ...

A GLM-5-shaped model (the tiny one's structure, widths from the flags; at the defaults 80M
parameters, ~5 GB of training state over the 4 ranks: larger ones need more than 23 GB of RAM in
the "before" format, which is what this measures) at DP = ``--ranks`` with the distributed optimizer and Adam, one optimizer
step taken so every moment is non-zero. Per format, ``--repeats`` times, on every rank:

- **before**: what ``checkpointing.state.save`` did: megatron's default torch_dist strategy,
  optimizer state ``fully_reshardable`` (every DP rank all-gathers its model shard's whole
  optimizer state), synchronous: training waits for the whole save;
- **after**: ``checkpointing.writer.CheckpointWriter`` with ``async_save``: megatron's fully
  parallel strategy, ``dp_reshardable`` optimizer state (each rank writes its own shard), the
  write in a background process; training waits only for the staging copy.

``--stage-end``: the final save of a stage at TP1 x DP ``--ranks`` whose next stage runs at TP2 x
DP ``--ranks``/2 and carries the optimizer state, through ``CheckpointWriter`` (async) as the run
does it; then the load of it in the TP2 layout. **before**: the optimizer state
``fully_reshardable`` (megatron's: every DP rank all-gathers its model shard's whole state);
**after**: ``model_space_shards`` (each rank writes and reads only its own share). Each TP2 rank's
loaded state (main parameters, both moments) is digested, and one more optimizer step is taken on
the same gradients and its weights digested: ``same state`` says whether both formats give every
rank bit-identical state and bit-identical weights after that step.

Columns: ``blocking`` (what the step loop waits; the median over repeats, max over ranks),
``total`` (until published: manifest, rename, ``latest``), ``load`` (``checkpointing.state.load``
of model, optimizer and scheduler), ``host RAM`` (peak RSS growth of a rank during its first save,
sampled every 2 ms from /proc, max over ranks; each format runs in processes of its own), and the planner's prediction of the last two
for this model and layout (``planner.checkpoint``). Ratios are after / before from the same run.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_overrides(hidden: int, layers: int) -> list[str]:
    """The benchmark model: the tiny GLM-5's structure (dense first layer, MoE with a shared expert,
    MLA, MTP) at ``hidden`` width; no DSA indexer (it does not change what a checkpoint is)."""
    return [f"model.hidden_size={hidden}", f"model.num_layers={layers}", f"model.ffn_hidden_size={4 * hidden}",
            f"model.moe_ffn_hidden_size={hidden}", f"model.num_attention_heads={max(4, hidden // 128)}",
            "model.vocab_size=32000", "model.mtp_num_steps=1", "model.dsa.mode=none"]


def run_config(ranks: int, hidden: int, layers: int, run_dir: str, tp: int = 1):
    from pretrain.config.schema import compose, to_run_config

    tp_overrides = [f"parallel.tp={tp}", "parallel.sequence_parallel=true"] if tp > 1 else []
    return to_run_config(compose(["curriculum=none", "parallel=dp2_distopt", "logger.wandb.mode=disabled",
                                  f"trainer.run_dir={run_dir}", *tp_overrides, *model_overrides(hidden, layers)]))


class PeakRSS:
    """Peak resident set size growth of this process while in the ``with`` block (bytes)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_grads(ddp, seed: int) -> None:
    """Gradients drawn per parameter name (the same in every process of one layout)."""
    import torch

    for c in ddp:
        for name, p in c.module.named_parameters():
            gen = torch.Generator().manual_seed(seed * 100_003 + sum(map(ord, name)))
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)


def state_digest(optimizer) -> str:
    """sha256 over this rank's optimizer shards (main parameters and moments, buffer order)."""
    import hashlib

    from parallel.megatron_compat import optimizer_wrappers

    h = hashlib.sha256()
    for w in optimizer_wrappers.wrappers(optimizer):
        for model_param, main in optimizer_wrappers.main_params(w):
            state = w.optimizer.state.get(main, {})
            for t in (main, state.get("exp_avg"), state.get("exp_avg_sq")):
                if t is not None:
                    h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def build(rc):
    """Model chunks, DDP, distributed Adam with every moment set by one step, scheduler."""
    import torch

    from pretrain.stage_build import build_stage

    built = build_stage(rc, "local", steps=10)
    random_grads(built.ddp, 0)
    built.optimizer.step()
    return built.chunks, built.optimizer, built.scheduler, built.ddp


def save_before(ckpt_dir, chunks, optimizer, scheduler, state, rc):
    """The save as it was: default strategy, fully_reshardable, synchronous, then published."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from checkpointing.files import iter_dir
    from checkpointing.state import full_state
    from checkpointing.writer import publish

    final = iter_dir(ckpt_dir, state.step)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(full_state(chunks, optimizer, scheduler, state, "", rc.parallel, reshardable=True), tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        publish(ckpt_dir, tmp, final, None, 0)
    dist.barrier()
    return final


def worker(args) -> None:
    import gc

    import torch.distributed as dist

    from checkpointing import state as checkpoint
    from checkpointing.writer import CheckpointWriter
    from parallel.initialize import initialize

    if args.stage_end:
        stage_end_worker(args)
        return
    if args.format == "before":  # the format of every save before issue 38: megatron's gathered one
        checkpoint.RESHARDABLE_OPTIMIZER_FORMAT = checkpoint.GATHERED_OPTIMIZER_FORMAT
    rc = run_config(args.ranks, args.hidden, args.layers, args.work)
    env = initialize(rc.parallel, 0)
    chunks, optimizer, scheduler, _ = build(rc)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    fmt = args.format  # one format per process: freed heap would hide the next one's growth
    ckpt_dir = os.path.join(args.work, fmt)
    writer = CheckpointWriter(ckpt_dir, 0, async_save=True)
    rows = {fmt: []}
    for r in range(args.repeats):
        state = checkpoint.TrainState(step=r + 1)
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        with PeakRSS() as rss:
            if fmt == "before":
                path = save_before(ckpt_dir, chunks, optimizer, scheduler, state, rc)
                blocking = total = time.perf_counter() - t0
            else:
                report = writer.save(chunks, optimizer, scheduler, state, "", rc.parallel)
                blocking = report.blocking_s
                total = writer.finish().total_s
                path = report.path
        dist.barrier()
        t1 = time.perf_counter()
        checkpoint.load(path, chunks, optimizer, scheduler)
        load = time.perf_counter() - t1
        rows[fmt].append((blocking, total, load, rss.growth))
    out = [None] * env.world_size
    dist.all_gather_object(out, {"rank": env.rank, "rows": rows, "params": params})
    if env.rank == 0:
        with open(os.path.join(args.work, f"result_{args.format}.json"), "w") as f:
            json.dump({"ranks": out, "rc_overrides": model_overrides(args.hidden, args.layers)}, f)


def stage_end_worker(args) -> None:
    """Save at TP1 as a stage's final checkpoint into another layout, load at TP2 (see the docstring)."""
    import gc

    import torch
    import torch.distributed as dist

    from checkpointing import state as checkpoint
    from checkpointing.writer import CheckpointWriter
    from parallel.initialize import initialize

    fmt = args.format
    if fmt == "before":  # the stage-end save as it was: the same writer, megatron's gathered format
        checkpoint.RESHARDABLE_OPTIMIZER_FORMAT = checkpoint.GATHERED_OPTIMIZER_FORMAT
    rc = run_config(args.ranks, args.hidden, args.layers, args.work)
    env = initialize(rc.parallel, 0)
    chunks, optimizer, scheduler, _ = build(rc)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    writer = CheckpointWriter(os.path.join(args.work, fmt), 0, async_save=True)
    gc.collect()
    dist.barrier()
    with PeakRSS() as rss:
        report = writer.save(chunks, optimizer, scheduler, checkpoint.TrainState(step=1), "", rc.parallel,
                             stage_final=True, reshardable=True)
        total = writer.finish().total_s
    del chunks, optimizer, scheduler
    gc.collect()
    rc2 = run_config(args.ranks, args.hidden, args.layers, args.work, tp=2)
    initialize(rc2.parallel, 0)
    chunks, optimizer, scheduler, ddp = build(rc2)  # a step of its own first: the load overwrites it
    gc.collect()
    dist.barrier()
    t1 = time.perf_counter()
    with PeakRSS() as load_rss:
        checkpoint.load(report.path, chunks, optimizer, scheduler)
    load = time.perf_counter() - t1
    loaded = state_digest(optimizer)
    for c in ddp:
        c.zero_grad_buffer()
    random_grads(ddp, 1)
    optimizer.step()
    stepped = __import__("hashlib").sha256(b"".join(
        p.detach().float().contiguous().numpy().tobytes() for c in chunks for p in c.parameters())).hexdigest()[:16]
    row = (report.blocking_s, total, load, rss.growth, load_rss.growth)
    out = [None] * env.world_size
    dist.all_gather_object(out, {"rank": env.rank, "rows": {fmt: [row]}, "params": params,
                                 "digest": [loaded, stepped]})
    if env.rank == 0:
        with open(os.path.join(args.work, f"result_{fmt}.json"), "w") as f:
            json.dump({"ranks": out}, f)
    torch.distributed.barrier()


def summarise_stage_end(result: dict) -> dict:
    table = {}
    for fmt in ("before", "after"):
        rows = [r["rows"][fmt][0] for r in result[fmt]["ranks"]]
        table[fmt] = {k: max(row[i] for row in rows) for i, k in enumerate(
            ("blocking_s", "total_s", "load_s", "host_ram_bytes", "load_host_ram_bytes"))}
    table["same_state"] = all(a["digest"] == b["digest"] for a, b in zip(result["before"]["ranks"],
                                                                        result["after"]["ranks"]))
    return table


def summarise(result: dict, ranks: int, hidden: int, layers: int, work: str) -> dict:
    """Per format: the median over repeats of the max over ranks of each column."""
    table = {}
    for fmt in ("before", "after"):
        per_repeat = zip(*[r["rows"][fmt] for r in result[fmt]["ranks"]])
        cols = [tuple(max(rank[i] for rank in rep) for i in range(4)) for rep in per_repeat]
        table[fmt] = {k: statistics.median(c[i] for c in cols)
                      for i, k in enumerate(("blocking_s", "total_s", "load_s"))}
        table[fmt]["host_ram_bytes"] = cols[0][3]  # the process's first save: later ones reuse its heap
    try:
        from planner.checkpoint import predict_for_run_config

        rc = run_config(ranks, hidden, layers, work)
        for fmt, legacy in (("before", True), ("after", False)):
            pred = predict_for_run_config(rc, world_size=ranks, legacy=legacy)
            table[fmt]["planned_host_ram_bytes"] = pred["host_ram_peak_gib"] * 2**30
            table[fmt]["planned_bytes_per_rank"] = pred["bytes_per_rank"]
    except ImportError:
        pass
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="checkpoint folder (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--stage-end", action="store_true",
                    help="a stage's final save at TP1, loaded at TP2: gathered against per-rank format")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", default="after", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import subprocess

    work = args.work or tempfile.mkdtemp(prefix="ckpt_bench_")
    result = {}
    for fmt in ("before", "after"):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", __file__,
               "--worker", f"--format={fmt}", f"--ranks={args.ranks}", f"--hidden={args.hidden}",
               f"--layers={args.layers}", f"--repeats={args.repeats}", f"--work={work}"]
        cmd += ["--stage-end"] if args.stage_end else []
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
        with open(os.path.join(work, f"result_{fmt}.json")) as f:
            result[fmt] = json.load(f)
    if args.stage_end:
        return print_stage_end(summarise_stage_end(result), result, args)
    table = summarise(result, args.ranks, args.hidden, args.layers, work)
    params = result["after"]["ranks"][0]["params"]
    print(f"model: {params / 1e6:.0f}M params per rank (hidden {args.hidden}, {args.layers} layers), "
          f"DP{args.ranks}, distributed Adam, fp32 on CPU; median of {args.repeats} saves, max over ranks")
    gib = 2**30
    print(f"{'':<22}{'before':>12}{'after':>12}{'after/before':>14}")
    for key, label, scale, unit in (("blocking_s", "blocking", 1, "s"), ("total_s", "total save", 1, "s"),
                                    ("load_s", "load", 1, "s"), ("host_ram_bytes", "host RAM per rank", gib, "GiB"),
                                    ("planned_host_ram_bytes", "  planner's", gib, "GiB"),
                                    ("planned_bytes_per_rank", "  planner's bytes/rank", gib, "GiB")):
        if key not in table["after"]:
            continue
        b, a = table["before"][key] / scale, table["after"][key] / scale
        print(f"{label + ' (' + unit + ')':<22}{b:>12.3f}{a:>12.3f}{(a / b if b else float('nan')):>13.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


def print_stage_end(table: dict, result: dict, args) -> None:
    params = result["after"]["ranks"][0]["params"]
    print(f"model: {params / 1e6:.0f}M params per rank at TP1 (hidden {args.hidden}, {args.layers} layers), "
          f"a stage's final save at TP1 x DP{args.ranks} loaded at TP2 x DP{args.ranks // 2}, distributed Adam, "
          f"fp32 on CPU; max over ranks")
    gib = 2**30
    print(f"{'':<26}{'gathered':>12}{'per rank':>12}{'ratio':>10}")
    for key, label, scale, unit in (("blocking_s", "blocking", 1, "s"), ("total_s", "total save", 1, "s"),
                                    ("load_s", "load at TP2", 1, "s"),
                                    ("host_ram_bytes", "save host RAM per rank", gib, "GiB"),
                                    ("load_host_ram_bytes", "load host RAM per rank", gib, "GiB")):
        b, a = table["before"][key] / scale, table["after"][key] / scale
        print(f"{label + ' (' + unit + ')':<26}{b:>12.3f}{a:>12.3f}{(a / b if b else float('nan')):>9.2f}x")
    print(f"same state at TP2 (loaded, and after one more step): {table['same_state']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
