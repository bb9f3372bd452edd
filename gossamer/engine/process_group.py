"""The torch process group of a node's local ranks: joined at start, torn down and left cleanly at the end."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from gossamer.core.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["backend_of", "check_one_gpu_per_rank", "end_process_group", "exit_process", "shared_gpu", "start_process_group"]


def backend_of(cuda: bool) -> str:
    """The process-group backend of a node's ranks: NCCL for CUDA tensors (with gloo for CPU ones) on GPUs."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def start_process_group(*, rank: int, world: int, port: int, cuda: bool) -> bool:
    """Join the node's process group over loopback (nothing to join for one local rank).

    Returns:
        Whether this process is now in a process group.
    """
    if world > 1 and not dist.is_initialized():
        # On GPUs, CUDA tensors go over NCCL and CPU tensors over gloo: the loop's small
        # counters, flags and eval sums are CPU tensors, which NCCL alone refuses ("No backend
        # type associated with device type cpu"), and moving each to the GPU costs a copy and
        # a sync either way.
        dist.init_process_group(backend=backend_of(cuda), init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        if cuda:
            check_one_gpu_per_rank(world, _gpu_id())
    return dist.is_initialized()


#: Bytes of a GPU's identity exchanged between local ranks (a UUID's text is 36 to 40).
_ID_BYTES = 64


def _gpu_id() -> str:
    """The current CUDA device's UUID ("" where this torch does not say it)."""
    try:
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return ""


def shared_gpu(ids: Sequence[str]) -> tuple[int, int, str] | None:
    """The first two local ranks (by rank) whose GPU identities in `ids` are equal, and that identity;
    None when each is on its own GPU (an empty identity, unknown, is never counted as shared)."""
    first: dict[str, int] = {}
    for rank, gpu in enumerate(ids):
        if gpu and gpu in first:
            return first[gpu], rank, gpu
        first.setdefault(gpu, rank)
    return None


def check_one_gpu_per_rank(world: int, gpu: str) -> None:
    """Refuse two local ranks on one GPU before NCCL's first collective would, with a duplicate-device
    error far from the cause or a hang (torchrun with 2 processes on a 1-GPU host: 200 s, seen on an
    H200). The identities travel as CPU tensors, over gloo; every rank raises alike.

    Raises:
        ConfigError: naming `nproc_per_node`, when two ranks share a GPU.
    """
    mine = torch.frombuffer(bytearray(gpu.encode()[:_ID_BYTES].ljust(_ID_BYTES, b"\0")), dtype=torch.uint8)
    every = [torch.zeros(_ID_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(every, mine)
    ids = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in every]
    shared = shared_gpu(ids)
    if shared is not None:
        a, b, which = shared
        raise ConfigError("nproc_per_node", f"local ranks {a} and {b} are both on GPU {which}: NCCL needs one GPU "
                                            "per rank. Start as many ranks as the node has GPUs (torchrun "
                                            "--nproc-per-node, srun --gpus-per-task=1), or train on CPU with gloo "
                                            "by setting CUDA_VISIBLE_DEVICES to an empty string")


def end_process_group(*, finished_together: bool) -> None:
    """Destroy this process's process group (every group), after a last barrier where that is safe.

    With `finished_together` every local rank is past its last collective and reaches this
    point, so the barrier makes none close its connections while another still uses them.
    After a failure or a stop request another rank may be gone or inside a collective that a
    barrier would be matched against: it is left out then.
    """
    if not dist.is_initialized():
        return
    if finished_together:
        try:
            dist.barrier()
        except RuntimeError as e:  # a local rank left meanwhile: tear down all the same
            log.warning("the final barrier of the node's ranks failed (%s)", e)
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a process that ran a torch process group now, skipping the interpreter's teardown.

    torch keeps a gloo process group alive after `destroy_process_group` once FSDP2 or DTensor
    touched it (a reference outside Python holds it: its worker and TCP-loop threads still run
    afterwards, even after a garbage collection). The interpreter's finalization and the C++
    static destructors would then tear those threads down, which can abort the rank with
    SIGABRT ("terminate called without an active exception"). Call this once the process has
    closed what it owns and left its process group: only logs and stdio are flushed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
