"""The torch process group of a node's local ranks: joined at start, torn down and left cleanly at the end."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["backend_of", "end_process_group", "exit_process", "start_process_group"]


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
    return dist.is_initialized()


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
