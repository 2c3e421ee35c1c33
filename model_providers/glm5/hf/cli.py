"""GLM-5 Hugging Face interop CLI.

    python -m model_providers.glm5.hf import HF_DIR OUT [--mtp-steps 3] [--dtype keep|bf16|fp32]
    python -m model_providers.glm5.hf export CKPT OUT_HF_DIR [--dtype keep|bf16|fp32]
    python -m model_providers.glm5.hf loss (--checkpoint CKPT | --hf HF_DIR) --tokens IDS.npy
                                          [--tp N --pp N --ep N --etp N] [--dsa-mode sparse|dense]

``import`` writes a megatron dist checkpoint that ``python -m pretrain.train
checkpoint.init_from=OUT`` loads at any TP/PP/EP layout (the run's ``model.*`` must describe the
same architecture; ``OUT/glm5_model.yaml`` lists it). ``export`` reads an imported or trained
checkpoint and writes ``config.json`` + safetensors shards that ``transformers`` loads. ``loss``
prints one JSON line ``{"loss": mean next-token cross-entropy, "tokens": N}`` for a [batch, seq]
int array, by the project's model (fp32; one rank, or the layout given under torchrun) or by
``transformers`` (``--hf``). ``import`` and ``export`` never delete or overwrite anything: OUT must
be absent or empty and apart from the source, and appears only when complete (``hf_paths``); a
wrong path, a damaged shard or an unsupported config ends with a message on stderr and exit
status 1. Mapping, memory and format notes: ``hf_convert``, ``hf_mapping``,
``dist_io``; config mapping and rejected fields: ``hf_config``.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import os
import sys

import numpy as np
import torch

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _import(args) -> dict:
    from model_providers.glm5.hf.convert import import_hf

    return import_hf(args.hf_dir, args.out, mtp_num_steps=args.mtp_steps, dtype=DTYPES[args.dtype])


def _export(args) -> dict:
    from model_providers.glm5.hf.convert import export_hf

    return export_hf(args.checkpoint, args.out, dtype=DTYPES[args.dtype],
                     max_shard_bytes=int(args.max_shard_gb * 2**30))


def _loss(args) -> dict:
    from model_providers.glm5.hf import paths as hf_paths
    if not os.path.isfile(args.tokens):
        raise hf_paths.HFPathError(f"--tokens {args.tokens} does not exist")
    try:
        array = np.load(args.tokens)  # allow_pickle=False: an object array is refused, not run
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: --tokens {args.tokens} is not a numpy integer array ({e})") from None
    if array.dtype.kind not in "iu":  # a float array would be truncated to other token ids
        raise SystemExit(f"error: --tokens {args.tokens} holds {array.dtype} values: token ids must be an integer array")
    tokens = torch.from_numpy(array).long()
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise SystemExit(f"error: --tokens must be a [batch>=1, seq>=2] int array, got shape {tuple(tokens.shape)}")
    if args.hf:
        from model_providers.glm5.hf.evaluate import hf_next_token_loss

        hf_paths.check_hf_dir(args.hf)
        loss, n = hf_next_token_loss(args.hf, tokens)
        return {"loss": loss, "tokens": n}
    from megatron.core import parallel_state

    from checkpointing.dist_io import check_files, load_common
    from model_providers.glm5.hf.convert import config_from_common
    from model_providers.glm5.hf.evaluate import build_eval_model, load_weights, next_token_loss
    from parallel.config import ParallelConfig, check_layout
    from parallel.initialize import dist_env, initialize

    hf_paths.check_checkpoint_dir(args.checkpoint)
    check_files(args.checkpoint)
    cfg = config_from_common(load_common(args.checkpoint))
    if int(tokens.max()) >= cfg.vocab_size or int(tokens.min()) < 0:
        raise SystemExit(f"error: --tokens ids must be in [0, {cfg.vocab_size})")
    env = dist_env()
    par = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                         sequence_parallel=args.tp > 1, cpu_emulation=args.cpu_emulation)
    _, problems = check_layout(par, world_size=env.world_size, num_layers=cfg.num_layers,
                               num_attention_heads=cfg.num_attention_heads,
                               num_experts=cfg.num_experts, seq_length=tokens.shape[1],
                               micro_batch_size=1, global_batch_size=tokens.shape[0])
    if problems:
        raise SystemExit("error: invalid layout for this checkpoint: " + "; ".join(problems))
    initialize(par, seed=1, env=env)
    chunks, _ = build_eval_model(cfg, par, args.dsa_mode)
    load_weights(args.checkpoint, chunks)
    loss, n = next_token_loss(chunks, tokens)
    parallel_state.destroy_model_parallel()
    return {"loss": loss, "tokens": n}


def _arg_rules() -> dict:
    """Each numeric option (argparse's name) -> its :class:`~pretrain.config.numbers.Rule`."""
    from pretrain.config.numbers import count, positive

    return {"mtp_steps": count(0, note="0: no MTP module"), "max_shard_gb": positive(),
            "tp": count(1), "pp": count(1), "ep": count(1), "etp": count(1, optional=True, note="null: --tp")}


def bad_arguments(args) -> list[str]:
    """Every numeric option out of its range, named as typed (``--max-shard-gb=nan ...``)."""
    rules = _arg_rules()
    return [why for name, value in vars(args).items() if name in rules
            for why in [rules[name].problem("--" + name.replace("_", "-"), value)] if why]


def _user_errors() -> tuple:
    from model_providers.glm5.hf.config import HFConfigError
    from model_providers.glm5.hf.convert import MissingWeightsError
    from checkpointing.dist_io import CheckpointFileError

    return CheckpointFileError, HFConfigError, MissingWeightsError  # HFPathError is a CheckpointFileError


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m model_providers.glm5.hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("import", help="HF safetensors -> megatron dist checkpoint")
    i.add_argument("hf_dir")
    i.add_argument("out")
    i.add_argument("--mtp-steps", type=int, default=3,
                   help="model.mtp_num_steps of the run (0: no MTP module)")
    i.add_argument("--dtype", choices=list(DTYPES), default="keep")
    e = sub.add_parser("export", help="megatron dist checkpoint -> HF safetensors")
    e.add_argument("checkpoint")
    e.add_argument("out")
    e.add_argument("--dtype", choices=list(DTYPES), default="keep")
    e.add_argument("--max-shard-gb", type=float, default=5.0)
    lo = sub.add_parser("loss", help="mean next-token cross-entropy of a token array")
    src = lo.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint")
    src.add_argument("--hf")
    lo.add_argument("--tokens", required=True, help=".npy int array [batch, seq]")
    lo.add_argument("--tp", type=int, default=1)
    lo.add_argument("--pp", type=int, default=1)
    lo.add_argument("--ep", type=int, default=1)
    lo.add_argument("--etp", type=int, default=None, help="expert TP (default: --tp)")
    lo.add_argument("--dsa-mode", choices=["sparse", "dense"], default="sparse")
    lo.add_argument("--cpu-emulation", choices=["plain", "strict"], default="plain",
                    help="without CUDA: strict also checks device placement (parallel.cpu_emulation)")
    args = p.parse_args(argv)
    bad = bad_arguments(args)
    if bad:  # before any file is read or written
        raise SystemExit(f"error: {'; '.join(bad)}")
    owned = not torch.distributed.is_initialized()
    try:
        result = {"import": _import, "export": _export, "loss": _loss}[args.cmd](args)
    except _user_errors() as e:  # a wrong path or an unsupported model: the message says it all
        raise SystemExit(f"error: {e.args[0] if isinstance(e, KeyError) else e}") from None
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    if owned and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
