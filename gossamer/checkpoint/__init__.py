"""Checkpoints: atomic directories with a sha256 manifest, and loading them back."""

from __future__ import annotations

from gossamer.checkpoint.load import load_checkpoint
from gossamer.checkpoint.manifest import read_manifest, save_model_checkpoint

__all__ = ["load_checkpoint", "read_manifest", "save_model_checkpoint"]
