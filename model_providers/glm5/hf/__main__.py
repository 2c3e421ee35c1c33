"""``python -m model_providers.glm5.hf``: see :mod:`model_providers.glm5.hf.cli`."""

from model_providers.glm5.hf.cli import main

main()
