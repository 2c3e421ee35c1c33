"""Each DSA core attention's top-k selection, read from outside the model: the production modules
keep no inspection state, so the probe wraps the ``select_topk`` that
``model_providers.glm5.model.dsa.attention`` calls and notes, with a forward pre-hook on every
:class:`~model_providers.glm5.model.dsa.attention.DSACoreAttention`, which core is selecting."""

from __future__ import annotations

import torch


class TopkProbe:
    """``with TopkProbe(model) as probe:`` ... then ``probe.latest[core]`` is the (idx [b, s', k],
    valid [b, s', k]) of that core's latest sparse selection (query rows past the dense prefix);
    a core that selected nothing (dense mode, or every query sees at most top-k keys) is absent."""

    def __init__(self, model: torch.nn.Module):
        from model_providers.glm5.model.dsa import attention

        self._attention = attention
        self.cores = [m for m in model.modules() if isinstance(m, attention.DSACoreAttention)]
        self.latest: dict = {}
        self._running = None

    def __enter__(self) -> "TopkProbe":
        self._select = self._attention.select_topk
        self._hooks = [c.register_forward_pre_hook(self._enter_core) for c in self.cores]
        self._attention.select_topk = self._recording_select
        return self

    def __exit__(self, *exc) -> None:
        self._attention.select_topk = self._select
        for h in self._hooks:
            h.remove()

    def _enter_core(self, core, args) -> None:
        self._running = core

    def _recording_select(self, *args, **kwargs):
        idx, valid = self._select(*args, **kwargs)
        self.latest[self._running] = (idx, valid)
        return idx, valid
