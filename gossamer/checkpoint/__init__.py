"""Checkpoints: atomic directories with a sha256 manifest, and loading them back."""

from __future__ import annotations

from gossamer.checkpoint.manifest import load_checkpoint, read_manifest, save_model_checkpoint

__all__ = ["load_checkpoint", "read_manifest", "save_model_checkpoint"]
