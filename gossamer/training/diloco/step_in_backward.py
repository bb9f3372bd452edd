"""An optimizer stepping each parameter inside backward, as soon as its gradient is final, then freeing that gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["SLICE_NUMEL", "StepInBackward"]

#: An AdamW parameter larger than this is stepped this many values at a time (a multiple of 64).
SLICE_NUMEL = 1 << 20


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
        """`opt.step()` over `params` only (each group given just its own of them), then free their gradients.
        A single AdamW parameter past `SLICE_NUMEL` values is stepped a slice at a time (`_step_sliced`)."""
        params = list(params)
        if len(params) == 1 and self._sliceable(params[0]):
            self._step_sliced(params[0])
            params[0].grad = None
            return
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

    def _sliceable(self, p: torch.Tensor) -> bool:
        g = self._group[id(p)]
        return (isinstance(self.opt, torch.optim.Adam) and p.numel() > SLICE_NUMEL and p.is_contiguous()
                and p.grad is not None and p.grad.is_contiguous() and not p.is_complex()
                and not any(g.get(k) for k in ("foreach", "fused", "capturable", "differentiable", "amsgrad")))

    def _step_sliced(self, p: torch.Tensor) -> None:
        """AdamW on `p` a slice of `SLICE_NUMEL` values at a time: its temporaries (the denominator, twice
        while it is made) are a slice's, not the parameter's (a 3584-wide layer: 51 MB each). The update is
        elementwise and the slices start at multiples of 64 values, where the whole tensor's vectorised loop
        is aligned too: the same bits (test_diloco_memory). Each slice steps a view with views of the state
        and a copy of the step count, which then counts the step once."""
        state = self.opt.state[p]
        if not state:  # the lazy initialisation `opt.step()` would make
            state["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                         else torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        g = self._group[id(p)]
        saved = g["params"]
        flat, grad = p.detach().view(-1), p.grad.view(-1)  # type: ignore[union-attr]
        moments = {k: state[k].view(-1) for k in ("exp_avg", "exp_avg_sq")}
        step = counted = state["step"]
        try:
            for a in range(0, flat.numel(), SLICE_NUMEL):
                view = flat[a : a + SLICE_NUMEL]
                view.grad = grad[a : a + SLICE_NUMEL]
                self.opt.state[view] = {"step": step.clone(), **{k: m[a : a + SLICE_NUMEL] for k, m in moments.items()}}
                g["params"] = [view]
                try:
                    self.opt.step()
                    counted = self.opt.state[view]["step"]
                finally:
                    del self.opt.state[view]
                    view.grad = None
        finally:
            g["params"] = saved
        state["step"] = counted

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
