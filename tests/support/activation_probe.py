"""``python -m tests.support.activation_probe OUT.json "BASE" CASE...``: the peak activation
memory of one training step of the tiny model, measured per rank, for several configs (and
parallel layouts of the launch's world size) in one launch.

BASE is a string of Hydra overrides (space-separated), composed once; each CASE a string of
``key=value`` fields set on top (``parallel.cp=2 trainer.seq_length=512 model.recompute=full``).
Per case every rank builds the model as ``pretrain.stage`` does (``pretrain.stage_build``:
provider, DSA mode, recompute, megatron DDP and optimizer) and runs ``pretrain.step.train_step``
on synthetic tokens; the step's forward-backward schedule runs under :class:`LiveTensorBytes`, which counts the bytes
of every tensor storage created meanwhile for as long as it lives. Its peak is the step's peak
live bytes minus those live at its start (weights, grad buffers, optimizer state are not
counted); the optimizer update after the schedule is skipped. Rank 0 writes
``[{"case", "ranks": [{"rank", "pp_rank", "cp_rank", "peak"}]}]`` to OUT.json.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import functools
import gc
import json
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive, and their peak.

    A storage is new when an op returns it and none of the op's inputs shares it: aten ops say
    so in their schema (outputs annotated as aliases are views or in-place/``out=`` results),
    other ops (collectives) are compared with their inputs. Its bytes count until it is freed
    (a weakref callback) and follow resizes (``out=`` results, ``UntypedStorage.resize_``, by
    which megatron frees and restores recomputed outputs)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0

    def _set(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self.sizes.get(key, 0)
        self.sizes[key] = nbytes
        if self.live > self.peak:
            self.peak = self.live

    def _free(self, key: int, _ref=None) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def _track(self, t: torch.Tensor, inputs) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            if self.sizes[key] != storage.nbytes():
                self._set(key, storage.nbytes())
        elif inputs is None or key not in inputs:
            self._set(key, storage.nbytes())
            self.refs[key] = weakref.ref(storage, functools.partial(self._free, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _output_kind(func)
        if kind == "alias":
            return out
        inputs = None
        if kind == "compare":
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
        for t in ((out,) if isinstance(out, torch.Tensor) else tree_leaves(out)):
            if not isinstance(t, torch.Tensor):
                continue
            if kind != "resize" or t.untyped_storage()._cdata in self.sizes:
                self._track(t, inputs)
        return out

    def __enter__(self):
        resize = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def tracked_resize(storage, size):
            result = resize(storage, size)
            if storage._cdata in tracker.sizes:
                tracker._set(storage._cdata, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


@functools.lru_cache(maxsize=None)
def _output_kind(func) -> str:
    """fresh: new storages (aten, no aliasing output); alias: views and in-place results (the
    storage and its size unchanged); resize: ``out=``/resize ops (known storages may grow);
    compare: not an aten op (outputs compared with the inputs' storages)."""
    if func.namespace != "aten":
        return "compare"
    if not any(r.alias_info is not None for r in func._schema.returns):
        return "fresh"
    resizing = func._schema.name in ("aten::resize_", "aten::set_", "aten::resize_as_")
    return "resize" if resizing or func._overloadname.startswith("out") else "alias"


class SyntheticTokens:
    """Random token sequences in the data pipeline's sample format (one document each)."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int = 0):
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed + i)
        tokens = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        return {"tokens": tokens[:-1].clone(), "labels": tokens[1:].clone(),
                "loss_mask": torch.ones(self.seq_length), "position_ids": torch.arange(self.seq_length)}


def measure(rc, env) -> int:
    """Peak live bytes of one training step's forward-backward on this rank for run config
    ``rc`` (the optimizer update is skipped: not measured, and a fresh optimizer's first step
    would only allocate its state)."""
    from megatron.core import parallel_state

    from model_providers.glm5.model.specs import resolve_backend
    from parallel.initialize import initialize
    from pretrain import step as one_step
    from pretrain.stage_build import build_stage

    t = rc.trainer
    initialize(rc.parallel, t.seed, env)
    parallel_state.destroy_global_memory_buffer()  # each case allocates its SP buffer in its step
    parallel_state._set_global_memory_buffer()
    built = build_stage(rc, resolve_backend(rc.model.layer_backend), steps=max(t.steps, 1))
    tcfg, ddp, optimizer, scheduler = built.tcfg, built.ddp, built.optimizer, built.scheduler
    optimizer.step = lambda: (True, 0.0, None)
    probe = one_step.configure_model_hooks(tcfg, ddp, optimizer)
    tracker = LiveTensorBytes()
    schedule = one_step.get_forward_backward_func

    def tracked_schedule():
        run = schedule()

        def tracked(**kwargs):
            gc.collect()
            with tracker:
                return run(**kwargs)
        return tracked

    one_step.get_forward_backward_func = tracked_schedule
    try:
        one_step.train_step(ddp, optimizer, scheduler, SyntheticTokens(t.seq_length, rc.model.vocab_size),
                        0, t, probe, rc.model.mtp_num_steps)
    finally:
        one_step.get_forward_backward_func = schedule
    return tracker.peak


def case_configs(base: list[str], cases: list[str]) -> list:
    """The run config of each case: ``base`` Hydra overrides (composed once), then the case's
    ``key=value`` fields (YAML values)."""
    from omegaconf import OmegaConf

    from pretrain.config.schema import compose, to_run_config

    composed = compose(base)
    return [to_run_config(OmegaConf.merge(composed, OmegaConf.from_dotlist(case.split())))
            for case in cases]


def main(out_path: str, base: list[str], cases: list[str]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from parallel.initialize import dist_env
    from parallel.megatron_compat import release_cached_modules

    env = dist_env()
    results = []
    gc.freeze()  # the imported modules: each case's collections scan only what the cases made
    for case, rc in zip(cases, case_configs(base, cases)):
        peak = measure(rc, env)
        mine = {"rank": env.rank, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "cp_rank": parallel_state.get_context_parallel_rank(), "peak": peak}
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, mine)
        results.append({"case": case, "ranks": ranks})
        moe_utils.get_moe_layer_wise_logging_tracker().clear()  # its groups may be the last layout's
        release_cached_modules()
        gc.collect()
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(), sys.argv[3:])
