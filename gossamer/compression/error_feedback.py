"""Error-feedback memory: what a biased codec dropped is added back to the next gradient."""

from __future__ import annotations

import torch

from gossamer.compression.codec import all_finite

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-key residuals for error feedback (EF-SGD), independent of any codec.

    Karimireddy et al. 2019, https://arxiv.org/abs/1901.09847 (and the "momentum
    correction"-free residual of DGC, https://arxiv.org/abs/1712.01887): each step sends
    C(g + e) and keeps e' = (g + e) - C(g + e), so what the codec drops is delayed, not
    lost. Use it as::

        compensated = ef.compensate(key, grad)
        payload = codec.encode(compensated)
        ef.update(key, compensated, codec.decode(payload, shape, torch.float32))

    Residuals are fp32 and live on the CPU. Invariant: after any sequence of steps,
    sum(decoded) + residual == sum(grads) up to float round-off.
    """

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor: `grad` plus the residual of `key` (none yet: a copy of `grad`).

        Raises:
            ValueError: the residual of `key` has another shape than `grad`.
        """
        g = grad.detach().to(torch.float32)
        r = self._residual.get(key)
        if r is None:
            return g.clone() if g.data_ptr() == grad.data_ptr() else g
        if r.shape != g.shape:
            raise ValueError(
                f"error feedback {key!r}: residual has shape {list(r.shape)}, "
                f"gradient {list(g.shape)}"
            )
        return g + r

    def compensate_in_place(self, key: str, grad: torch.Tensor) -> torch.Tensor | None:
        """`grad` plus `key`'s residual in the residual's own buffer, taken out (the caller `keep`s the
        next residual); None where it cannot be (no residual, another shape, dtype or device, or the
        same storage as `grad`): use `compensate`.

        r + g is the same fp32 sum as g + r; a new sum and a new residual per step were two fresh
        tensors, faulted in page by page in role processes (`worker.allocator`).

        Raises:
            ValueError: `grad` holds NaN or Inf (refused before the residual is touched).
        """
        r = self._residual.get(key)
        if (r is None or r.shape != grad.shape or r.dtype != torch.float32 or grad.dtype != torch.float32
                or r.device != grad.device or r.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()):
            return None
        if not all_finite(grad):
            raise ValueError(f"error feedback {key!r}: cannot compensate values holding NaN or Inf")
        del self._residual[key]
        return r.add_(grad.detach())

    def update(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``compensated - decoded`` (what the receiver did not get) as `key`'s residual."""
        if compensated.shape != decoded.shape:
            raise ValueError(
                f"error feedback {key!r}: compensated {list(compensated.shape)} and decoded "
                f"{list(decoded.shape)} differ in shape"
            )
        self._residual[key] = compensated.detach().float() - decoded.detach().float()

    def keep(self, key: str, residual: torch.Tensor) -> None:
        """Keep `residual` itself (computed by the caller, in a buffer it hands over) as `key`'s residual."""
        self._residual[key] = residual

    def take(self, key: str) -> torch.Tensor | None:
        """Remove `key`'s residual and return it (None if it has none): the caller folds it in elsewhere."""
        return self._residual.pop(key, None)

    def residual(self, key: str) -> torch.Tensor | None:
        """The current residual of `key` (not a copy), or None."""
        return self._residual.get(key)

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of `key`, or all residuals."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._residual

    def __len__(self) -> int:
        return len(self._residual)
