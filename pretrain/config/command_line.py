"""A command line of Hydra overrides to what a run takes: :func:`resolve` (the run config, its
resolved YAML, the fields the overrides changed) and :func:`hydra_problem` (Hydra's refusal as
one line). ``python -m pretrain.train``, ``python -m data_pipeline.prepare`` and the tests' rank
pools read a command line through both, so they accept and refuse the same ones."""

from __future__ import annotations

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.config.errors import ConfigError
from pretrain.config.overrides import changed_fields
from pretrain.config.schema import CONF_DIR, RunConfig, compose, to_run_config


def resolve(cfg: DictConfig, overrides: list[str]) -> tuple[RunConfig, str, list]:
    """What ``pretrain.train.run`` takes, from the composed config and the overrides that made
    it: the run config, its resolved YAML and the fields the overrides changed. Raises
    ConfigError."""
    try:
        rc = to_run_config(cfg)  # a key forced in with +group.key=..., a bad interpolation
        config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError("invalid config", [_omegaconf_problem(e)]) from None
    return rc, config_yaml, changed_fields(overrides, compose, CONF_DIR, full=cfg)


def _omegaconf_problem(e: Exception) -> str:
    """An OmegaConf error's first line, and the field (``full_key``) when that line lacks it."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    key = getattr(e, "full_key", None)
    return f"{first} ({key})" if key and key not in first else first


def hydra_problem(overrides: list[str]) -> "str | None":
    """Hydra's own refusal of the command line (an unknown key or config option, a value of the
    wrong type, override syntax) as one line, or None. Composed once before the app so these
    read like every other config error (``error: ...``, exit status 1) instead of Hydra's
    multi-line report."""
    try:
        compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        text = str(e).split("\nConfig search path")[0]
        if e.__cause__ is not None and str(e.__cause__):  # what was wrong with the key or value
            text += "\n\n" + str(e.__cause__).splitlines()[0]
        sentences = []
        for paragraph in text.split("\n\n"):
            lines = [ln.strip() for ln in paragraph.splitlines() if ln.strip()]
            if lines and lines[0].endswith(":"):  # a heading and its list: "options in 'x': a, b"
                lines = [f"{lines[0]} {', '.join(lines[1:])}"]
            sentences += [ln if ln.endswith((".", ":")) else ln + "." for ln in lines]
        return " ".join(sentences)
    return None
