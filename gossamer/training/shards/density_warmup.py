"""DGC's density warm-up on a worker: sparse codecs send more entries in the first steps."""

from __future__ import annotations

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.worker_momentum import warmup_density
from gossamer.core.codec_table import parse_spec
from gossamer.paramserver.shard_client import ShardClient

__all__ = ["DensityWarmup", "warm_spec"]


def warm_spec(spec: str, step: int, warmup_steps: int) -> str:
    """`spec` with a sparse codec's ratio raised to its warm-up density at `step` (others as they are)."""
    entry, arg = parse_spec(spec)
    if not entry.sparse or not isinstance(arg, float):
        return spec
    ratio = warmup_density(arg, step, warmup_steps)
    return spec if ratio == arg else f"{entry.name}:{ratio!r}"


class DensityWarmup:
    """Installs, step by step, a compressor whose sparse codecs use DGC's warm-up density.

    A push names its codecs, so a shard decodes whatever density a stage uses; the error
    feedback residuals and the momentum move to each new compressor, so nothing is lost at a
    change (as with the adaptive policy's swaps).
    """

    def __init__(self, client: ShardClient, steps: int) -> None:
        base = client.compressor
        if base is None:
            raise ValueError("density warm-up needs a compressor")
        self.client = client
        self.steps = steps
        self.spec = base.default_spec
        self.overrides = list(base.overrides)
        self._seed = base.seed
        self._stage: tuple[str, tuple[tuple[str, str], ...]] = (self.spec, tuple(self.overrides))

    def at(self, step: int) -> None:
        """Use the densities of 0-based `step` for the next push."""
        spec = warm_spec(self.spec, step, self.steps)
        overrides = tuple((p, warm_spec(s, step, self.steps)) for p, s in self.overrides)
        old = self.client.compressor
        if (spec, overrides) == self._stage or old is None:
            return
        new = ChunkCompressor(spec, old.plan, overrides=overrides, shapes=old.shapes, seed=self._seed,
                              momentum=old.momentum, error_feedback=old.error_feedback,
                              unbiased_random=old.unbiased_random)
        new.feedback = old.feedback
        new.raw_bytes, new.wire_bytes = old.raw_bytes, old.wire_bytes
        new.encode_seconds, new.decode_seconds = old.encode_seconds, old.decode_seconds
        self.client.compressor = new
        self._stage = (spec, overrides)
