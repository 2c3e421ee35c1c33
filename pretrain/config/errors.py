"""The one error a run's configuration raises: every problem found, listed, before any compute.

Checks everywhere (``parallel.config``, ``model_providers.glm5.model.config``, ``data_pipeline.config``,
``pretrain.curriculum``, ``pretrain.config.overrides``) return lists of problems; ``pretrain.config.validation``
collects them for every stage and raises this once.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """The run cannot work as configured; ``problems`` lists each reason (naming fields, values)."""

    def __init__(self, title: str, problems: list[str]):
        self.title, self.problems = title, list(problems)
        super().__init__(f"{title}:\n  - " + "\n  - ".join(self.problems))

    def brief(self) -> str:
        """One line when there is one problem (``title: problem``), else the list."""
        return f"{self.title}: {self.problems[0]}" if len(self.problems) == 1 else str(self)
