"""The addition example: a verifiable toy task that trains in minutes on a CPU.

Everything specific to it lives here: the task (``a+b=``, scored by exact match), its dataset
generator, a one-token-per-character tokenizer and a small causal LM built from scratch. The
model and tokenizer are written with ``save_pretrained``, so every other part of rlbus loads them
with ``from_pretrained`` like any published checkpoint, and scores through ``producers.tasks.Task``
like any task.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from consumers.dataset import DatasetFields
from trainer.config import WarmupConfig

logger = logging.getLogger(__name__)

TASK = "rlbus.examples.addition:AdditionTask"
"""Import path of the task, as ``run.task`` names it."""

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
DEFAULT_CHARSET = "0123456789+-*=() "
"""Characters of the arithmetic tasks; anything else encodes as ``<unk>``."""


class ScratchModelConfig(BaseModel):
    """The small causal LM the example builds from scratch (no downloads)."""

    model_config = ConfigDict(extra="forbid")

    arch: str = Field(default="qwen2", description="transformers model_type of a causal LM (qwen2, qwen3, llama, mistral, ...).")
    tokenizer: Literal["chars", "bpe"] = Field(
        default="chars",
        description="chars: one token per character of the arithmetic charset (addition); bpe: a byte-level BPE "
        "trained on the train prompts and answers with the tokenizers library (any text task).",
    )
    bpe_vocab_size: int = Field(default=512, ge=300, description="Vocabulary of the BPE tokenizer (256 bytes + merges).")
    hidden_size: int = Field(default=128, ge=8, description="Width of the residual stream.")
    layers: int = Field(default=2, ge=1, description="Number of transformer blocks.")
    heads: int = Field(default=4, ge=1, description="Attention heads (query and key/value).")
    intermediate_size: int = Field(default=512, ge=8, description="Width of the MLP.")
    max_position_embeddings: int = Field(default=64, ge=8, description="Longest sequence, prompt + completion, in tokens.")
    seed: int = Field(default=0, description="Seed of the weight initialisation.")
    num_experts: int | None = Field(
        default=None, ge=2,
        description="A mixture of experts (an arch such as qwen3_moe, qwen2_moe, olmoe or mixtral): experts per MoE "
        "layer, each an MLP of intermediate_size; None: a dense model.",
    )
    top_k: int = Field(default=2, ge=1, description="Mixture of experts: experts each token is routed to, per layer.")


class AdditionConfig(BaseModel):
    """The example's data, model and warm-up, used where [data] and [model] name nothing of their own."""

    model_config = ConfigDict(extra="forbid")

    max_operand: int = Field(default=20, ge=1, description="Operands of a+b are in [0, max_operand).")
    sort_length: int = Field(default=4, ge=2, le=16, description="run.task = sort: digits per string to sort.")
    sort_prompts: int = Field(default=10_000, ge=2, description="run.task = sort: distinct strings (at most 10^sort_length).")
    n_heldout: int = Field(default=100, ge=1, description="Prompts held out for evaluation, never trained on.")
    model: ScratchModelConfig = Field(default_factory=ScratchModelConfig, description="The model built from scratch.")
    warmup: WarmupConfig = Field(
        default_factory=WarmupConfig,
        description="Supervised warm-up of the scratch model: a random model never answers right, so RL would "
        "see no reward.",
    )


class AdditionTask:
    """``a+b=`` prompts; the completion must be the decimal sum and nothing else."""

    name = "addition"

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0 if completion.strip() == answer.strip() else 0.0

    def write_example_dataset(self, out_dir: Path, config: AdditionConfig, *, seed: int) -> tuple[Path, Path]:
        """The example's data for this task (and for any task without data of its own)."""
        return write_dataset(out_dir, seed=seed, max_operand=config.max_operand, n_heldout=config.n_heldout)


def write_dataset(
    out_dir: Path, *, seed: int, max_operand: int, n_heldout: int, min_operand: int = 0
) -> tuple[Path, Path]:
    """Write every ``a+b=`` with ``min_operand <= a, b < max_operand``, split into train/held-out.

    The split is a seeded shuffle of distinct prompts, so no held-out prompt appears in train.
    Returns the paths of ``train.jsonl`` and ``heldout.jsonl``.
    """
    pairs = [(a, b) for a in range(min_operand, max_operand) for b in range(min_operand, max_operand)]
    if not 0 <= n_heldout < len(pairs):
        raise ValueError(f"n_heldout={n_heldout} must be in [0, {len(pairs)}) for {len(pairs)} prompts")
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt_id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return write_split(out_dir, rows, n_heldout, "addition")


def write_split(out_dir: Path, rows: list[dict], n_heldout: int, what: str) -> tuple[Path, Path]:
    """Write ``rows[n_heldout:]`` to ``out_dir/train.jsonl`` and ``rows[:n_heldout]`` to
    ``out_dir/heldout.jsonl``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    splits = rows[n_heldout:], rows[:n_heldout]
    for path, split in zip(paths, splits):
        with path.open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in split)
    logger.info("wrote %d train and %d held-out %s prompts to %s", len(splits[0]), len(splits[1]), what, out_dir)
    return paths


def _byte_level_symbol(ch: str) -> str:
    """The byte-level alphabet symbol of one ASCII character (space becomes 'Ġ')."""
    from tokenizers import pre_tokenizers

    symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)
    return symbols[0][0]


def build_tokenizer(charset: str = DEFAULT_CHARSET):
    """One token per character; ``encode`` prepends ``<bos>``, ``decode`` concatenates.

    The model is a byte-level BPE without merges. That is what ``AutoTokenizer`` rebuilds for
    Qwen2 checkpoints whatever ``tokenizer.json`` says, so the tokenizer behaves identically
    whether it is loaded as ``Qwen2Tokenizer`` (qwen2) or as ``TokenizersBackend`` (llama).
    Characters outside ``charset`` have no token.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not charset.isascii():
        raise ValueError(f"charset must be ASCII, got {charset!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(charset):
        vocab.setdefault(_byte_level_symbol(ch), len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )


def build_model(
    out_dir: Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    charset: str = DEFAULT_CHARSET,
    seed: int = 0,
    num_experts: int | None = None,
    top_k: int = 2,
    tokenizer: str = "chars",
    bpe_vocab_size: int = 512,
    texts: list[str] | None = None,
) -> Path:
    """Write a randomly initialised ``arch`` model and its tokenizer to ``out_dir``; verify reload.
    With ``tokenizer="bpe"`` the tokenizer is a byte-level BPE trained on ``texts``."""
    from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer

    if tokenizer == "bpe":
        if not texts:
            raise ValueError("a BPE tokenizer needs texts to train on")
        tok = train_bpe_tokenizer(texts, vocab_size=bpe_vocab_size, chat_template=False)
    else:
        tok = build_tokenizer(charset)
    out_dir = build_checkpoint(out_dir, tok, arch=arch, hidden_size=hidden_size, layers=layers, heads=heads,
                               intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                               seed=seed, num_experts=num_experts, top_k=top_k)
    if tokenizer == "chars":  # every character of the charset must come back as itself
        from transformers import AutoTokenizer

        reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
        if reloaded.decode(reloaded(charset)["input_ids"], skip_special_tokens=True) != charset:
            raise RuntimeError(f"tokenizer in {out_dir} does not round-trip {charset!r}")
    return out_dir


def prepare(
    out_dir: Path,
    config: AdditionConfig,
    *,
    task,
    seed: int,
    model_path: str | None = None,
    train_path: str | None = None,
    heldout_path: str | None = None,
    fields: DatasetFields | None = None,
    device: str = "auto",
    turn_tokens: int = 16,
) -> dict:
    """The example's part of `rlbus prepare`: its dataset unless ``train_path`` is given (the task's,
    ``write_example_dataset``, when it has one: addition's or sorting's; else addition's), its scratch
    model (with the supervised warm-up) unless ``model_path`` is. Returns the paths and the
    warm-up's figures. ``turn_tokens``: the tokens of one turn of a multi-turn task's episodes
    (sampling.max_new_tokens), which the warm-up plays to score the model."""
    import torch

    from consumers.dataset import read_rows
    from producers.episodes import is_multi_turn
    from trainer.warmup import demonstration_text, supervised_warmup

    torch.set_num_threads(2)
    out_dir = Path(out_dir)
    if train_path is None:
        writer = getattr(task, "write_example_dataset", None) or AdditionTask().write_example_dataset
        train, heldout = writer(out_dir / "data", config, seed=seed)
    else:
        train, heldout = Path(train_path), Path(heldout_path or train_path)
    result = {"train_path": str(train), "heldout_path": str(heldout), "warmup_steps": 0, "warmup_seconds": 0.0,
              "warmup_train_accuracy": None}
    if model_path is not None:
        return {**result, "model_dir": str(model_path)}
    rows = read_rows(train, fields)
    # An episode's gold turns, when the task gives them: trained on the model's turns only.
    demonstration = getattr(task, "demonstration_turns", None) or getattr(task, "demonstration", None)
    show = demonstration or (lambda answer: answer)
    texts = [f"{r.prompt}{demonstration_text(show(r.answer))}" for r in rows] \
        if config.model.tokenizer == "bpe" else None
    model_dir = build_model(out_dir / "base", **config.model.model_dump(), texts=texts)
    w = config.warmup
    evaluate = None
    if is_multi_turn(task):  # scored as RL will see it: whole episodes, the environment answering each turn
        evaluate = functools.partial(_episode_score, task, rows[: w.eval_prompts], model_dir, turn_tokens, seed)
    report = supervised_warmup(
        model_dir, rows, score=task.score, target_accuracy=w.target_accuracy, max_steps=w.max_steps,
        batch_size=w.batch_size, lr=w.lr, seed=seed, eval_rows=rows[: w.eval_prompts],
        eval_every_steps=w.eval_every_steps, demonstration=demonstration, device=device, evaluate=evaluate,
    )
    return {**result, "model_dir": str(model_dir), "warmup_steps": report.steps,
            "warmup_seconds": round(report.seconds, 2), "warmup_train_accuracy": report.accuracy}


def _episode_score(task, rows, model_dir: Path, turn_tokens: int, seed: int, model) -> float:
    """Greedy score of ``model`` playing whole episodes of ``rows`` (saved to ``model_dir`` first)."""
    import asyncio

    from producers.engines.torch_engine import TorchEngine
    from producers.evaluate import greedy_accuracy

    model.save_pretrained(model_dir)
    engine = TorchEngine(model_dir, device=str(model.device), seed=seed)
    return asyncio.run(greedy_accuracy(engine, task, rows, turn_tokens))
