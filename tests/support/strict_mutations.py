"""``python -m tests.support.strict_mutations MUTATION [overrides]``: the training entry point
with one GPU-placement mistake put back from outside, to show the strict CUDA emulation catches
it. MUTATION:

- ``batch_on_host``: batches are handed to the model as built, never moved to the device;
- ``host_collective``: the per-step preemption vote all-reduces a host tensor;
- ``host_parameter``: model chunks are not moved to the device after build, so plain torch modules
  (the DSA indexer's projections, the local spec's norms) keep host parameters.
"""

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import runpy
import sys

import torch

import model_providers.glm5.model.provider as provider
import pretrain.reliability.faults as faults
import pretrain.step as one_step


def main() -> None:
    mutation = sys.argv.pop(1)
    if mutation == "batch_on_host":
        one_step.to_device = lambda batch: batch
    elif mutation == "host_collective":
        faults.current_device = lambda: torch.device("cpu")
    elif mutation == "host_parameter":
        provider.current_device = lambda: torch.device("cpu")
    else:
        raise SystemExit(f"unknown mutation {mutation!r}")
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
