"""An optimizer stepping each parameter inside backward, as soon as its gradient is final, then freeing that gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["StepInBackward"]


class StepInBackward:
    """Steps `opt` parameter by parameter from post-accumulate-grad hooks, so no whole-model gradient is held.

    After backward has summed a parameter's gradient (every use of it done), the hook steps that
    parameter alone and drops its `.grad`: at most a layer's gradient lives at a time instead of
    the model's. The optimizers used here (SGD, AdamW) are elementwise per parameter, so the
    parameters end exactly where one `opt.step()` after backward puts them (same implementation,
    fewer tensors per call). A parameter backward did not reach is stepped by `finish` with a zero
    gradient, as a flat gradient buffer (zeroed before backward) would have given it.

    Only where nothing has to see the whole gradient before the step: no clipping by its global
    norm, no fp16 loss scaling (unscale, finite check) and no all-reduce across local ranks. The
    hooks step only inside `armed()`; any other backward accumulates as usual.
    """

    def __init__(self, opt: torch.optim.Optimizer, model: nn.Module) -> None:
        self.opt = opt
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._group = {id(p): g for g in opt.param_groups for p in g["params"]}
        self._stepped: set[int] = set()
        self._armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Inside: the hooks step; at the end, every parameter backward did not reach is stepped too."""
        self._armed, self._stepped = True, set()
        try:
            yield
        finally:
            self._armed = False
        self.finish()

    def _hook(self, p: torch.Tensor) -> None:
        if self._armed:
            self._step([p])
            self._stepped.add(id(p))

    def finish(self) -> None:
        """Step the parameters the last backward did not reach, with a zero gradient."""
        rest = [p for p in self.params if id(p) not in self._stepped]
        self._stepped = set()
        for p in rest:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if rest:
            self._step(rest)

    def _step(self, params: Iterable[torch.Tensor]) -> None:
        """`opt.step()` over `params` only (each group given just its own of them), then free their gradients."""
        params = list(params)
        groups = {id(g): g for g in (self._group[id(p)] for p in params)}
        saved = {k: g["params"] for k, g in groups.items()}
        try:
            for g in groups.values():
                g["params"] = [p for p in params if self._group[id(p)] is g]
            self.opt.step()
        finally:
            for k, g in groups.items():
                g["params"] = saved[k]
        for p in params:
            p.grad = None  # the other parameters hold none either (freed, or not reached yet): not stepped

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
