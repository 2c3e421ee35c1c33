"""``recipe=NAME`` (conf/recipe/): one name for model, data, curriculum, optimizer, precision, the
per-stage layouts and the cluster. Each recipe composes exactly the config of its long form,
overrides on top still win, the planner plans for the recipe's cluster, and a launch whose size
is not the recipe's is refused naming cluster.nodes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from planner.__main__ import cluster_to_plan, split_arguments
from pretrain.config.errors import ConfigError
from pretrain.config.schema import compose, to_run_config
from pretrain.config.validation import plan_run

#: recipe -> its long form (what docs/recipes.md and each recipe's header say it is)
LONG_FORMS = {
    "glm5_744b_h200x512": "curriculum=glm5 parallel=glm5_h200_512gpu cluster.name=h200_141gb cluster.nodes=64",
    "glm5_744b_h100x1024": "curriculum=glm5 parallel=glm5_h100_1024gpu cluster.name=h100_80gb cluster.nodes=128",
    "dsv3_671b_h100x1024": "model=deepseek_v3_671b parallel=dsv3_h100_1024gpu precision=fp8_blockwise "
                           "optimizer=adam data=samples curriculum=none trainer.seq_length=4096 "
                           "trainer.global_batch_size=8192 cluster.name=h100_80gb cluster.nodes=128",
    "glm5_tiny_cpu": "",
}


def _yaml(overrides) -> str:
    return OmegaConf.to_yaml(compose(list(overrides)))


@pytest.mark.parametrize("recipe", sorted(LONG_FORMS))
def test_a_recipe_is_its_long_form(recipe):
    assert _yaml([f"recipe={recipe}"]) == _yaml(LONG_FORMS[recipe].split())


def test_the_glm5_recipe_sets_every_part_and_overrides_still_win():
    rc = to_run_config(compose(["recipe=glm5_744b_h200x512"]))
    assert (rc.model.num_layers, rc.precision.dtype, rc.optimizer.name, rc.parallel.tp, rc.cluster.name,
            rc.cluster.nodes) == (78, "bf16", "muon", 4, "h200_141gb", 64)
    assert len(rc.curriculum.stages) == 7 and set(rc.parallel.stages) == {s.name for s in rc.curriculum.stages}
    assert "pretrain" in rc.data.mixtures
    over = to_run_config(compose(["recipe=glm5_744b_h200x512", "parallel=glm5_h100_1024gpu", "model.num_layers=10",
                                  "cluster.nodes=32", "precision=fp32"]))
    assert (over.model.num_layers, over.parallel.tp, over.parallel.ep, over.cluster.nodes, over.precision.dtype) \
        == (10, 4, 32, 32, "fp32")


def test_the_planner_plans_for_the_recipes_cluster_unless_told_another():
    def planned(*argv):
        args = split_arguments(list(argv))
        return cluster_to_plan(args, compose(args["overrides"]))

    assert planned("recipe=glm5_744b_h200x512") == ("h200_141gb", {"nodes": 64})
    assert planned("recipe=glm5_744b_h200x512", "cluster.nodes=32") == ("h200_141gb", {"nodes": 32})
    assert planned("recipe=glm5_744b_h200x512", "cluster=b200_180gb") == ("b200_180gb", {"nodes": 64})
    # the run config takes the cluster planned for, so the run validates at the planned size
    args = split_arguments(["recipe=glm5_744b_h200x512", "cluster=b200_180gb", "cluster.nodes=32"])
    assert to_run_config(compose(args["overrides"])).cluster == type(to_run_config(compose([])).cluster)(
        name="b200_180gb", nodes=32)
    with pytest.raises(ConfigError, match="cluster=NAME or a recipe=NAME is required"):
        planned("curriculum=none")


def test_a_launch_of_another_size_than_the_recipes_is_refused():
    rc = to_run_config(compose(["recipe=glm5_tiny_cpu", "cluster.name=h100_80gb", "cluster.nodes=1",
                                "curriculum=none", "trainer.global_batch_size=32"]))
    plan_run(rc, 8, check_paths=False)  # 1 node x 8 GPUs: the recipe's size
    with pytest.raises(ConfigError) as e:
        plan_run(rc, 2, check_paths=False)
    assert e.value.problems == [
        "cluster.nodes=1 x 8 GPUs per node (h100_80gb) is 8 ranks, this launch has 2: submit it with "
        "sbatch --nodes=1, or set cluster.nodes to the nodes it runs on (with a layout for that size)"]
    for choice, problem in ((["cluster.nodes=4"], "cluster.nodes=4 needs cluster.name"),
                            (["cluster.name=a100"], "cluster.name='a100' is not a preset")):
        rc = to_run_config(compose(["recipe=glm5_tiny_cpu", *choice]))
        with pytest.raises(ConfigError) as e:
            plan_run(rc, 1, check_paths=False)
        assert any(p.startswith(problem) for p in e.value.problems), e.value.problems
