"""The environment a run used (library versions, devices, host), stored with checkpoints and experiments."""

from __future__ import annotations

import platform
import socket
import sys
from typing import Any


def fingerprint(device: Any = None) -> dict[str, Any]:
    """Versions of python, torch, CUDA, cuDNN and NCCL, the device model and the host name.

    cuDNN, NCCL and the device model are read only for a CUDA `device`; a CPU role (a shard)
    records the CUDA build torch was made for and leaves them empty.

    Two runs that should match bit for bit need equal fingerprints; a difference here is
    the first thing to look at when they do not.
    """
    import torch

    from gossamer.core.version import __version__

    # Only a rank on a GPU asks the CUDA libraries: on a GPU host, cudnn.version() and
    # nccl.version() load their libraries into every CPU role (a shard's checkpoint grew its
    # process by 39 MB on an H200 machine), and nothing a CPU role computes depends on them.
    on_gpu = getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available()
    nccl = ""
    if on_gpu:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 — a CUDA build without NCCL
            nccl = ""
    info: dict[str, Any] = {
        "gossamer": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": str(torch.backends.cudnn.version() or "") if on_gpu else "",
        "nccl": nccl,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "hostname": socket.gethostname(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }
    return info
