"""The final-checkpoint replacement deletes the old directory before the rename: a crash between loses both.

Issue 15 ("Smaller"): "the final-checkpoint replacement deletes the old directory before the
rename". Here, in-process through the tree's public checkpoint API: `save_model_checkpoint`
writes a final checkpoint (w = 1) and then replaces it (w = 2) while a fault makes the rename of
the new directory into place fail (os.replace of the `.tmp-` directory raises, as a crash or a
full disk there would stop it). Then `load_checkpoint` of the path. PASS: it still loads the
previous checkpoint (w = 1): the old directory was not deleted before the new one was in place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from _common import Outcome, main

NAME = "final_ckpt_replace"


def run(label: str) -> Outcome:
    import torch

    from gossamer.checkpoint import load_checkpoint, save_model_checkpoint

    root = Path(tempfile.mkdtemp(prefix="repro15-final-"))
    dest = root / "final"
    real_replace = os.replace
    faulted: list[str] = []

    def crashing_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str], **kw: object) -> None:
        if ".tmp-" in Path(src).name:
            faulted.append(f"{Path(src).name} -> {Path(dst).name}")
            raise OSError(28, "injected: the rename of the new checkpoint into place failed")
        real_replace(src, dst, **kw)  # type: ignore[arg-type]

    try:
        save_model_checkpoint(dest, {"w": torch.ones(4)}, {"step": 1})
        os.replace = crashing_replace  # type: ignore[assignment]
        try:
            save_model_checkpoint(dest, {"w": torch.full((4,), 2.0)}, {"step": 2})
            second = "replacement succeeded (the fault did not fire)"
        except OSError as e:
            second = f"replacement failed: {e}"
        finally:
            os.replace = real_replace
        left = sorted(p.name for p in root.iterdir())
        try:
            w = load_checkpoint(dest)["w"]
            loaded = f"loads w = {float(w[0])}"
            ok = float(w[0]) == 1.0
        except Exception as e:  # noqa: BLE001 - the loss is what the issue names
            loaded, ok = f"load fails: {type(e).__name__}: {str(e)[:100]}", False
    finally:
        os.replace = real_replace
        shutil.rmtree(root, ignore_errors=True)
    passed = ok and bool(faulted)
    figure = f"{second[:90]}; then {dest.name}/ {loaded}; directory holds {left}"
    return Outcome(NAME, passed, figure, {"faulted": faulted, "left": left, "loaded": loaded})


if __name__ == "__main__":
    main(NAME, run)
