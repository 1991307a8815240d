"""The model side of a policy's trainer, on one rank or several.

A ``Learner`` holds the policy (a ``PolicyModel``), its optimizer, the value model (VAPO) and the
frozen reference (KL), on this rank's device. Under ``torchrun`` each is sharded with FSDP2
(``fully_shard`` per decoder layer, then the whole), and rank 0 is the trainer: it alone talks to
Kafka and the store, and before each collective action it tells the other ranks which one comes
(``Learner.serve`` is their loop): a step (with its trajectory groups, in the wire format), a
gathering of the full weights for publication, a checkpoint, or the end.
"""

from __future__ import annotations

import enum
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from broker.schema import TrajectoryGroup
from trainer.config import TrainerConfig
from trainer.logprobs import PolicyModel, check_fast_paths, checkpoint_layers
from trainer.ranks import OneRank, Ranks
from trainer.step import StepResult, autocast_dtype, train_step
from trainer.value import Critic

logger = logging.getLogger(__name__)


class _Op(enum.IntEnum):
    STEP = 1
    WEIGHTS = 2
    SAVE = 3
    RESTORE = 4
    STOP = 5


_HEADER = struct.Struct("<BQ")  # op, step


@dataclass
class Learner:
    policy: PolicyModel
    optimizer: torch.optim.Optimizer
    config: TrainerConfig
    pad_id: int
    temperature: float
    ranks: Ranks
    critic: Critic | None = None
    reference: PolicyModel | None = None

    @property
    def lm(self) -> torch.nn.Module:
        """The causal LM (its parameter names are those published and checkpointed)."""
        return self.policy.lm

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def describe(self) -> str:
        ranks = f"{self.ranks.world} ranks (FSDP2), " if self.ranks.world > 1 else ""
        dtype = autocast_dtype(self.config, self.device)
        mode = "own forward (whole logits)" if self.policy.own_forward else (
            f"{'shared-prefix' if self.policy.shared_prefix else 'plain'} forward, LM head in "
            f"{self.config.logits_chunk_mib:g} MiB chunks")
        return (f"learner on {ranks}{self.device} ({type(self.lm).__name__}), autocast "
                f"{'none' if dtype is None else str(dtype).removeprefix('torch.')}, {mode}, micro-batches of "
                f"{self.config.micro_batch_tokens or 'auto'} tokens"
                f"{', activation checkpointing' if self.config.gradient_checkpointing else ''}")

    # -- what every rank does together ---------------------------------------------------------
    def step(self, groups: list[TrajectoryGroup], step: int) -> StepResult:
        """Optimizer step number ``step`` (0-based; the lr schedule and value pretraining go by it)."""
        self._tell(_Op.STEP, step, _encode_groups(groups))
        multiplier = self.config.lr_multiplier(step)
        for param_group in self.optimizer.param_groups:  # schedule by step: stateless on resume
            param_group["lr"] = self.config.lr * multiplier
        frozen = False
        if self.critic is not None:
            for param_group in self.critic.optimizer.param_groups:
                param_group["lr"] = self.critic.base_lr * multiplier
            frozen = step < self.critic.config.pretrain_steps  # value pretraining
        return train_step(self.policy, self.optimizer, groups, self.config, pad_id=self.pad_id,
                          temperature=self.temperature, critic=self.critic, reference=self.reference,
                          policy_frozen=frozen, ranks=self.ranks)

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full weights under the LM's own names as private CPU copies, floating ones in ``dtype``,
        gathered one tensor at a time (never the whole model on one device at once); on rank 0 (the
        others get {}). Tied weights are gathered once and stored under each name as a copy of its
        own, as ``WeightPublisher.cast`` makes them (safetensors refuses tensors that share memory)."""
        self._tell(_Op.WEIGHTS)
        out: dict[str, torch.Tensor] = {}
        gathered: dict[tuple, torch.Tensor] = {}
        for name, tensor in self.lm.state_dict().items():
            local = getattr(tensor, "_local_tensor", tensor)
            key = (local.data_ptr(), tuple(tensor.shape), str(tensor.dtype))  # tied weights are gathered once
            if key in gathered:
                if self.ranks.rank == 0:
                    out[name] = gathered[key].clone()
                continue
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.ranks.rank != 0:
                gathered[key] = torch.empty(0)
                continue
            cast = dtype if full.is_floating_point() else full.dtype
            out[name] = gathered[key] = full.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
        return out

    def save(self, root: Path, *, version: int, offsets: dict[str, dict[int, int]], extra: dict[str, Any],
             keep: int) -> Path | None:
        """Checkpoint ``version`` under ``root``: every rank writes its shards, rank 0 commits it."""
        from trainer.checkpoint import commit_checkpoint, staging_dir

        staging = staging_dir(root, version) if self.ranks.rank == 0 else None
        staging = Path(self._tell(_Op.SAVE, version, None if staging is None else str(staging).encode()).decode())
        self._write(staging)
        if self.ranks.rank == 0:
            return commit_checkpoint(root, staging, version=version, offsets=offsets, extra=extra, keep=keep)
        return None

    def restore(self, path: Path | None) -> bool:
        """Load the checkpoint at ``path`` (rank 0's choice; None: none) on every rank; whether the
        value model came from it (False when the trainer has none or the checkpoint holds none)."""
        from trainer.checkpoint import load_latest_checkpoint

        chosen = self._tell(_Op.RESTORE, 0, b"" if path is None else str(path).encode()).decode()
        if not chosen:
            return False
        ckpt = load_latest_checkpoint(Path(chosen).parent)
        assert ckpt is not None and ckpt.path == Path(chosen), f"checkpoint {chosen} moved while restoring"
        ckpt.restore(self.lm, self.optimizer)
        return self.critic is not None and ckpt.restore_value(self.critic.model, self.critic.optimizer)

    def stop(self) -> None:
        """Rank 0, at a clean end: the other ranks leave ``follow`` and every rank closes its groups."""
        self._tell(_Op.STOP)
        self.ranks.close()

    def serve(self) -> None:
        """Ranks other than 0: do what rank 0 says, until it says stop."""
        while True:
            op, step, payload = self._hear()
            if op == _Op.STEP:
                self.step(_decode_groups(payload), step)
            elif op == _Op.WEIGHTS:
                self.weights(torch.float32)
            elif op == _Op.SAVE:
                self._write(Path(payload.decode()))
            elif op == _Op.RESTORE:
                self.restore(Path(payload.decode()) if payload else None)
            elif op == _Op.STOP:
                self.ranks.close()
                return

    # -- the control channel -------------------------------------------------------------------
    def _tell(self, op: _Op, step: int = 0, payload: bytes | None = b"") -> bytes:
        """Rank 0 announces ``op`` (a no-op on one rank, and when a follower re-enters a method
        ``follow`` called); returns rank 0's payload."""
        if self.ranks.world == 1 or self.ranks.rank != 0:
            return payload or b""
        self.ranks.broadcast(_HEADER.pack(op, step) + (payload or b""))
        return payload or b""

    def _hear(self) -> tuple[_Op, int, bytes]:
        message = self.ranks.broadcast(None)
        op, step = _HEADER.unpack_from(message)
        return _Op(op), step, message[_HEADER.size:]

    def _write(self, staging: Path) -> None:
        from trainer.checkpoint import write_states

        write_states(staging, model=self.lm, optimizer=self.optimizer,
                     value=None if self.critic is None else (self.critic.model, self.critic.optimizer))
        self.ranks.barrier()


def _encode_groups(groups: list[TrajectoryGroup]) -> bytes:
    from broker.codec import encode_group

    parts = [encode_group(g) for g in groups]
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _decode_groups(data: bytes) -> list[TrajectoryGroup]:
    from broker.codec import decode_group

    groups, at = [], 0
    while at < len(data):
        (size,) = struct.unpack_from("<Q", data, at)
        at += 8
        groups.append(decode_group(data[at:at + size], max_decompressed_bytes=1 << 40))
        at += size
    return groups


def build_learner(config: TrainerConfig, model_dir: Path, *, temperature: float, device: torch.device,
                  ranks: Ranks | None = None) -> tuple[Learner, Any]:
    """The learner of the checkpoint at ``model_dir`` on ``device`` (sharded over ``ranks``), and its
    tokenizer. The fast paths are checked on this architecture first (``check_fast_paths``)."""
    from trainer.model import load_policy

    ranks = ranks or OneRank()
    lm, tokenizer = load_policy(model_dir, "float32", device=str(device))
    if config.routing_replay:
        from producers.engines.moe import routing_shape

        if routing_shape(lm) is None:  # also refuses an MoE router it cannot replay, naming it
            raise ValueError(f"trainer.routing_replay is on, but {model_dir} ({type(lm).__name__}) is a dense model: "
                             "routing replay is for mixture-of-experts policies; set trainer.routing_replay = false")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    policy = check_fast_paths(lm, lm.get_input_embeddings().num_embeddings, pad_id, shared_prefix=config.shared_prefix,
                              chunk_mib=config.logits_chunk_mib)
    config = config.model_copy(update={"shared_prefix": policy.shared_prefix})
    _prepare(policy, config, ranks)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    critic = reference = None
    if config.advantage_estimator == "gae":
        critic = Critic.build(config, model_dir, str(device))
        _prepare(critic.model, config, ranks)
        critic.optimizer = torch.optim.AdamW(critic.model.parameters(), lr=critic.base_lr, betas=config.betas,
                                             weight_decay=config.weight_decay)
    if config.kl_coef > 0:
        ref_lm, _ = load_policy(Path(config.kl_reference) if config.kl_reference else model_dir, "float32", str(device))
        reference = PolicyModel(ref_lm.eval().requires_grad_(False), shared_prefix=policy.shared_prefix,
                                chunk_mib=config.logits_chunk_mib, own_forward=policy.own_forward)
        _prepare(reference, config, ranks, checkpointing=False)
    return Learner(policy, optimizer, config, pad_id, temperature, ranks, critic, reference), tokenizer


def _prepare(model: torch.nn.Module, config: TrainerConfig, ranks: Ranks, *, checkpointing: bool | None = None) -> None:
    """Activation checkpointing (``gradient_checkpointing``) and, over several ranks, FSDP2: each
    decoder layer its own unit (gathered only while it runs), then the rest (embeddings, norm, heads)."""
    if config.gradient_checkpointing if checkpointing is None else checkpointing:
        checkpoint_layers(model)
    if ranks.world == 1:
        return
    from torch.distributed.fsdp import fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        fully_shard(layer)
    fully_shard(model)
