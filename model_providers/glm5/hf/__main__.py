"""``python -m model_providers.glm5.hf``: see :mod:`model_providers.glm5.hf.cli`."""

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

from model_providers.glm5.hf.cli import main

main()
