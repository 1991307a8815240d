"""The trainer's ranks: how many, which one this is, the reductions that make a step's figures
global, and the channel on which rank 0 tells the others what to do next. One process is
``OneRank``; ``torchrun`` processes are ``ProcessGroupRanks`` over ``torch.distributed`` (gloo on
CPUs; NCCL on GPUs for the model, with a gloo group beside it for the small control messages)."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Literal, Protocol

import torch

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(hours=24)
"""How long ranks other than 0 wait for its next message: rank 0 may wait long for trajectories (or
its turn); a rank that dies ends the others' wait at once (its connections close, and torchrun stops
the rest)."""
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective of the model (FSDP2's gathers and reductions, the step's reductions) waits
for the other ranks: they enter each one together, so a longer wait is a fault, reported as an error."""


class Ranks(Protocol):
    world: int
    rank: int

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """``tensor`` reduced over the ranks (a new CPU tensor; every rank gets the result)."""
        ...

    def barrier(self) -> None: ...

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        ...

    def close(self) -> None:
        """Every rank, together, at a clean end: nothing is in flight, then the groups go."""
        ...


class OneRank:
    world = 1
    rank = 0

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        return tensor.detach().cpu().clone()

    def barrier(self) -> None:
        return None

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def close(self) -> None:
        return None


class ProcessGroupRanks:
    """The default process group (``device``: where its collectives run, a GPU under NCCL) and a gloo
    group for control messages, which may wait much longer (``CONTROL_TIMEOUT``)."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.device = device
        self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        import torch.distributed as dist

        out = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._control)

    def broadcast(self, data: bytes | None) -> bytes:
        import torch.distributed as dist

        size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._control)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(buffer, src=0, group=self._control)
        return bytes(buffer.numpy()) if self.rank else data

    def close(self) -> None:
        """A barrier, then the process groups are destroyed: a rank that exits with its gloo
        connections open can abort ("terminate called without an active exception") when another
        rank's exit closes them under its threads."""
        import torch.distributed as dist

        dist.barrier(group=self._control)
        dist.destroy_process_group()


def join_ranks(device: str) -> tuple[Ranks, torch.device]:
    """This process's ranks and device: under ``torchrun`` (``WORLD_SIZE`` > 1) it joins the process
    group (NCCL on ``cuda:LOCAL_RANK`` when ``device`` gives GPUs, else gloo on the CPU); alone, one
    rank on ``device`` ('auto': cuda when present, else cpu)."""
    import torch.distributed as dist

    from trainer.model import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return OneRank(), torch.device(resolve_device(device))
    from broker.embedded import die_with_parent

    die_with_parent()  # torchrun starts its ranks in sessions of their own: they go when it goes
    if os.getppid() == 1:
        raise SystemExit("the torchrun that started this trainer rank is gone")
    on_gpu = resolve_device(device).startswith("cuda")
    if on_gpu:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                device_id=where if on_gpu else None)
    ranks = ProcessGroupRanks(where)
    logger.info("trainer rank %d of %d on %s (%s)", ranks.rank, ranks.world, where, dist.get_backend())
    return ranks, where
