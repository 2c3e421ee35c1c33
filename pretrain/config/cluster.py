"""The cluster a run is for: ``cluster.name``, a hardware preset (``conf/cluster/<name>.yaml``),
and ``cluster.nodes``, the job's node count. A recipe (``conf/recipe/``) sets both; the planner
plans for them, and a launch whose world size is not ``nodes`` x the preset's ``gpus_per_node`` is
refused before anything is built. Both null (the default): a run names no cluster and is not
checked. The presets' hardware fields and the planner's factors: ``planner/cluster.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

CLUSTER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "conf", "cluster")


@dataclass
class ClusterChoice:
    name: Optional[str] = None  #: a preset in conf/cluster/ (null: the run names no cluster)
    nodes: Optional[int] = None  #: the job's nodes (null: any size)


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CLUSTER_DIR) if f.endswith(".yaml"))


def gpus_per_node(name: str) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(os.path.join(CLUSTER_DIR, f"{name}.yaml")).get("gpus_per_node", 8))


def cluster_world(choice: ClusterChoice) -> int | None:
    """The ranks a launch of the run's cluster has (None: the run names no size)."""
    if choice.name not in preset_names() or choice.nodes is None:
        return None
    return choice.nodes * gpus_per_node(choice.name)


def cluster_problems(choice: ClusterChoice, world_size: int) -> list[str]:
    """Why a launch of ``world_size`` ranks is not the run's cluster (empty: it is, or the run
    names none)."""
    names = preset_names()
    if choice.name is None:
        return [] if choice.nodes is None else [
            f"cluster.nodes={choice.nodes} needs cluster.name, the hardware preset it counts nodes of "
            f"({', '.join(names)})"]
    if choice.name not in names:
        return [f"cluster.name={choice.name!r} is not a preset in {CLUSTER_DIR} ({', '.join(names)})"]
    want = cluster_world(choice)
    if want is None or world_size == want:
        return []
    return [f"cluster.nodes={choice.nodes} x {want // choice.nodes} GPUs per node ({choice.name}) is {want} "
            f"ranks, this launch has {world_size}: submit it with sbatch --nodes={choice.nodes}, or set "
            f"cluster.nodes to the nodes it runs on (with a layout for that size)"]
