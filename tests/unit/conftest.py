"""Shared fixtures of the one-process tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo process group with megatron's groups (TP = PP = 1), torn down after the
    module; for tests that build megatron modules directly."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize

    initialize(ParallelConfig(), seed=5, env=DistEnv.one_process())
    # megatron's layer-wise loss tracker is process-global and sized by the first model that
    # logs into it: every module starts from an empty one
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
