"""The trainer role: a policy's learner assembled from its settings, resumed, and run.

Resume: the newest checkpoint of the policy under ``run_dir`` restores model, optimizer, counters
and the offsets its intake seeks to. Versions in the store only move forward: when the store is
already past the checkpoint (a crash after publishing), the resumed weights become the next
version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.control import ControlAnnouncer
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.intake import IntakeConfig, TrainerIntake
from consumers.stages import StageSpec, build_group_stages
from consumers.turns import Turns, TurnGate
from trainer.config import TrainerConfig
from weightstore.config import WeightsConfig
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

TORCH_THREADS = 1
"""The trainer's intra-op threads: the local stack shares its cores with broker and workers."""


def run_trainer(
    *,
    kafka: KafkaConfig,
    topics: Topics,
    policy: str,
    store: ObjectStore,
    config: TrainerConfig,
    weights: WeightsConfig,
    intake: IntakeConfig,
    stages: list[StageSpec],
    temperature: float,
    max_staleness: int,
    model_dir: Path,
    run_dir: Path,
    metrics_path: Path,
    descriptor: dict[str, Any],
    should_stop: Callable[[], bool],
    signing_key: bytes | None = None,
    turns: Turns | None = None,
) -> int:
    """Train ``policy`` until ``config.max_steps`` or ``should_stop()``; returns the version reached.

    ``descriptor`` is written to the store for workers that attach with only --broker and --store.
    ``turns``: the run's trainers take turns; this one waits for its own before each step.
    """
    import torch

    from trainer.checkpoint import load_latest_checkpoint
    from trainer.loop import PolicyTrainer, TrainerState
    from trainer.model import load_policy, resolve_device
    from weightstore.follow import WeightFollower
    from weightstore.modelfiles import publish_model_files, write_run_descriptor
    from weightstore.publish import WeightPublisher

    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    model, tokenizer = load_policy(model_dir, "float32", device=device)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if config.shared_prefix:
            logger.info("gradient checkpointing is on: training with the plain forward (shared prefix needs the KV cache)")
            config = config.model_copy(update={"shared_prefix": False})
    logger.info("learner on %s (%s), autocast %s", device, type(model).__name__, config.autocast_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    publish_model_files(store, policy, model_dir)
    write_run_descriptor(store, descriptor)
    publisher = WeightPublisher(store, policy, weights, publisher_id=f"trainer-{topics.run}")

    state, resume_offsets = TrainerState(version=0), None
    ckpt = load_latest_checkpoint(run_dir / "checkpoints" / policy)
    if ckpt is not None:
        ckpt.restore(model, optimizer)
        state = TrainerState(version=ckpt.version, groups_trained=ckpt.extra.get("groups_trained", 0),
                             groups_consumed=ckpt.extra.get("groups_consumed", 0))
        resume_offsets = {int(p): o for p, o in ckpt.offsets.get(topics.trajectories(policy), {}).items()}
        state.offsets = dict(resume_offsets)
        logger.info("resumed from checkpoint at version %d", ckpt.version)
    latest = WeightFollower(store, policy).latest_version()
    if latest is not None and latest >= state.version:
        state.version = latest + 1  # versions only move forward: the resumed weights are the next one

    announcer = ControlAnnouncer(kafka, topics)
    # Token ids are valid below the embedding's size (checkpoints often pad it beyond the tokenizer).
    vocab_size = model.get_input_embeddings().num_embeddings
    intake_reader = TrainerIntake(kafka, topics, policy, intake, max_staleness=max_staleness,
                                  vocab_size=vocab_size, signing_key=signing_key)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if config.shared_prefix and not shared_prefix_agrees(model, vocab_size, pad_id):
        config = config.model_copy(update={"shared_prefix": False})
    gate = None if turns is None else TurnGate(kafka, topics, policy, turns)
    trainer = PolicyTrainer(
        policy=policy, config=config, model=model, optimizer=optimizer, pad_id=pad_id, temperature=temperature,
        intake=intake_reader, publisher=publisher, announcer=announcer, run_dir=run_dir,
        metrics_path=metrics_path, stages=build_group_stages(stages),
        wait_turn=None if gate is None else (lambda version: gate.wait(version, should_stop)),
    )
    trainer.publish(state)
    intake_reader.start(resume_offsets)
    try:
        state = trainer.run(state, should_stop)
        trainer.checkpoint(state)
    finally:
        try:
            trainer.close()  # publications still queued finish (and commit) before the intake closes
        finally:
            intake_reader.close()
            if gate is not None:
                gate.close()
    announcer.finished(policy, state.version, state.groups_consumed,
                       reason="trainer stopped" if should_stop() else "trainer finished")
    announcer.close()
    logger.info("trainer done at version %d, %d groups trained", state.version, state.groups_trained)
    return state.version


def shared_prefix_agrees(model, vocab_size: int, pad_id: int) -> bool:
    """Whether the shared-prefix forward gives this architecture the plain forward's log-probs, on
    two synthetic groups; when it does not (or fails), the trainer uses the plain forward and says so."""
    import time

    import numpy as np
    import torch

    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
    from trainer.batch import collate
    from trainer.loss import sequence_logprobs, shared_prefix_logprobs

    rng = np.random.default_rng(0)
    low = min(3, vocab_size - 1)
    groups = []
    for g, (prompt_len, lengths) in enumerate(((5, (3, 1, 4)), (2, (2, 3)))):
        completion = rng.integers(low, vocab_size, size=sum(lengths)).astype(np.int32)
        header = TrajectoryHeader(
            run="check", policy="check", group_id=f"g{g}", prompt_id=f"p{g}", task="check", worker_id="check",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=[0.0] * len(lengths),
            finish_reasons=["stop"] * len(lengths), min_version=0, max_version=0, vocab_size=vocab_size,
            created_at=time.time())
        groups.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(low, vocab_size, size=prompt_len).astype(np.int32),
            completion_tokens=completion, completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=np.zeros(len(completion), np.float32), token_versions=np.zeros(len(completion), np.int32)))
    batch = collate(groups, pad_id=pad_id).to(next(model.parameters()).device)
    kind = type(model).__name__
    try:
        with torch.no_grad():
            plain = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
            shared = shared_prefix_logprobs(model, batch)
    except Exception as exc:  # any failure of the fast path on this architecture means: do not use it
        logger.warning("%s: the shared-prefix forward failed (%s); training with the plain forward", kind, exc)
        return False
    mask = batch.completion_mask > 0
    gap = float((plain[mask] - shared[mask]).abs().max())
    if gap > 1e-3:
        logger.warning("%s: shared-prefix log-probs differ from the plain forward by %.2g; training with the plain "
                       "forward", kind, gap)
        return False
    return True
