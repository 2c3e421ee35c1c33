"""``python -m planner [recipe=NAME] [run overrides] [cluster=NAME] [cluster.FIELD=V] [--search]
[plan.json=PATH]``

Sizes every curriculum stage of a run on a named cluster (``cluster=NAME``, else the recipe's)
before anything is allocated: memory per pipeline rank (weights, grads, main params, optimizer
state, activations, the optimizer step), FLOPs per token, estimated step time, tokens/s/GPU, MFU
and GPU-hours. ``--search`` ranks the layouts that validate and fit for each stage by estimated
step time and prints the winner's overrides. Exit status: 0 every stage validates and fits, 1 a stage does not fit, 2 bad input.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import json
import math
import os
import sys

from pretrain.config.errors import ConfigError

USAGE = ("usage: python -m planner [recipe=NAME] [run overrides ...] [cluster=NAME] "
         "[cluster.FIELD=VALUE ...] [--search] [--stage NAME] [plan.json=PATH] [plan.min_headroom=0.1]")


def split_arguments(argv: list[str]) -> dict:
    """The planner's own arguments apart from the run's Hydra overrides."""
    out = {"overrides": [], "cluster": None, "cluster_overrides": {}, "json": None, "search": False,
           "stage": None, "min_headroom": None}
    args = list(argv)
    while args:
        a = args.pop(0)
        if a in ("-h", "--help"):
            raise SystemExit(print(__doc__ + "\n" + USAGE) or 0)
        if a == "--search":
            out["search"] = True
        elif a == "--stage" or a.startswith("--stage="):
            out["stage"] = a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else None)
            if not out["stage"]:
                raise ConfigError("bad planner arguments", ["--stage needs a stage name"])
        elif a.startswith("cluster="):
            out["cluster"] = a.split("=", 1)[1]
        elif a.startswith("cluster.") and "=" in a:
            key, value = a[len("cluster."):].split("=", 1)
            out["cluster_overrides"][key] = value
        elif a.startswith("plan.json="):
            out["json"] = a.split("=", 1)[1]
            problem = _json_path_problem(out["json"])
            if problem:
                raise ConfigError("bad planner arguments", [problem])
        elif a.startswith("plan.min_headroom="):
            value = a.split("=", 1)[1]
            try:
                out["min_headroom"] = float(value)
            except ValueError:
                out["min_headroom"] = math.nan
            if not 0 <= out["min_headroom"] < 1:
                raise ConfigError("bad planner arguments", [f"plan.min_headroom={value}: the share of GPU memory "
                                                            f"a stage leaves free, a number in [0, 1)"])
        elif a.startswith("plan.") or a.startswith("-"):
            raise ConfigError("bad planner arguments", [f"unknown planner argument {a!r}; {USAGE}"])
        else:
            out["overrides"].append(a)
    # the run config holds the cluster too (a recipe sets it): the run validates for the cluster
    # planned for, and a command line's cluster=NAME / cluster.nodes=N win over the recipe's
    if out["cluster"] is not None:
        out["overrides"].append(f"cluster.name={out['cluster']}")
    if "nodes" in out["cluster_overrides"]:
        out["overrides"].append(f"cluster.nodes={out['cluster_overrides']['nodes']}")
    return out


def _json_path_problem(path: str) -> str | None:
    """Why ``plan.json=path`` could not be written, checked before the plan is made."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path):
        return f"plan.json={path}: a folder (give a file path)"
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        return f"plan.json={path}: {existing} is not a writable folder"
    return None


def resolve_run(overrides: list[str], world_size: int, cfg=None):
    """``(rc, stages, problems)``: the run config, its stages and every problem
    ``pretrain.train`` would report at launch at ``world_size`` (corpus and tokenizer files aside;
    they are on the cluster). Stages come back even when some do not validate, so ``--search`` can
    look for a layout that does."""
    from pretrain.config.schema import CONF_DIR, compose, to_run_config
    from pretrain.curriculum import plan
    from pretrain.config.overrides import changed_fields
    from pretrain.config.numbers import check_numbers
    from pretrain.config.validation import plan_run

    cfg = compose(overrides) if cfg is None else cfg
    rc = to_run_config(cfg)
    check_numbers(rc)  # bad input (exit 2): a NaN or a zero divisor is not something --search can fix
    stages, problems = plan(rc)
    if problems:
        raise ConfigError("invalid curriculum", problems)
    changes = changed_fields(overrides, compose, CONF_DIR, full=cfg)
    try:
        plan_run(rc, world_size, changes, check_paths=False)
    except ConfigError as e:
        return rc, stages, e.problems
    return rc, stages, []


def cluster_to_plan(args: dict, cfg) -> tuple[str, dict]:
    """(preset name, field overrides): the run config's cluster -- a recipe's, or the command
    line's cluster=NAME / cluster.nodes=N, which :func:`split_arguments` passes to it -- and the
    command line's other cluster.FIELD=V."""
    from planner.cluster import preset_names

    name = cfg.cluster.name
    if name is None:
        raise ConfigError("bad planner arguments", [f"cluster=NAME or a recipe=NAME is required (cluster "
                                                    f"presets: {', '.join(preset_names())})"])
    fields = dict(args["cluster_overrides"])
    if cfg.cluster.nodes is not None:
        fields["nodes"] = cfg.cluster.nodes
    return name, fields


def main(argv: list[str]) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from planner import report
    from pretrain.config.schema import compose
    from planner.cluster import load_cluster
    from planner.stage_plan import MIN_HEADROOM, mark_stage_changes, plan_stage

    try:
        args = split_arguments(argv)
        cfg = compose(args["overrides"])
        cluster = load_cluster(*cluster_to_plan(args, cfg))
        world = cluster.world_size
        rc, stages, run_problems = resolve_run(args["overrides"], world, cfg)
        if args["stage"] is not None and args["stage"] not in [s.name for s in stages]:
            raise ConfigError("bad planner arguments", [f"--stage {args['stage']!r} is not a stage of this "
                                                        f"curriculum ({', '.join(s.name for s in stages)})"])
    except ConfigError as e:
        print(f"error: {e.brief()}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    headroom = MIN_HEADROOM if args["min_headroom"] is None else args["min_headroom"]
    chosen = [s for s in stages if args["stage"] in (None, s.name)]
    shown = " ".join(o for o in args["overrides"] if not o.startswith("cluster.")) or "(defaults)"
    print(f"plan: {shown} on {cluster.name}: {cluster.nodes} nodes x "
          f"{cluster.gpus_per_node} GPUs = {world} ({cluster.gpu_memory_gib:g} GiB, "
          f"{cluster.bf16_tflops:g} bf16 TFLOP/s each); a stage fits with >= {headroom:.0%} of memory free")
    plans = [plan_stage(s.name, s.steps, s.rc, world, cluster, headroom, s.trainable) for s in chosen]
    mark_stage_changes(stages, plans, cluster)
    print(report.table(plans, cluster))
    ckpt = report.checkpoint_table(plans, cluster)
    if ckpt:
        print("\n" + ckpt)
    if run_problems:
        print(f"\nthe run does not validate at {world} GPUs:\n  - " + "\n  - ".join(run_problems))
    for p in plans:
        if not p.problems:
            print()
            print(report.rank_table(p))
            print(report.time_lines(p))
    assumptions = next((p.step.assumptions for p in plans if p.step is not None), {})
    if assumptions:
        print("\nassumptions: " + "; ".join(f"{k}={v}" for k, v in assumptions.items()))
    searched = True
    if args["search"]:
        from planner.search import search_report

        text, searched = search_report(stages, chosen, rc, cluster, headroom, args["overrides"])
        print("\n" + text)
    if args["json"]:
        _write_json(args["json"], report.plan_json(plans, cluster, args["overrides"]))
    if run_problems:
        return 2
    return 0 if searched and all(p.fits for p in plans) else 1


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
