"""Build a tiny causal LM and its character-level tokenizer from scratch, into a directory.

Nothing is downloaded: the tokenizer is made with the ``tokenizers`` library, the model from an HF
config with random weights, and both are written with ``save_pretrained`` so that every other part
of the system loads them with ``from_pretrained`` like any published checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
DEFAULT_CHARSET = "0123456789+-*=() "
"""Characters of the arithmetic tasks; anything else encodes as ``<unk>``."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _byte_level_symbol(ch: str) -> str:
    """The byte-level alphabet symbol of one ASCII character (space becomes 'Ġ')."""
    symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)
    return symbols[0][0]


def build_tokenizer(charset: str = DEFAULT_CHARSET) -> PreTrainedTokenizerFast:
    """One token per character; ``encode`` prepends ``<bos>``, ``decode`` concatenates.

    The model is a byte-level BPE without merges. That is what ``AutoTokenizer`` rebuilds for
    Qwen2 checkpoints whatever ``tokenizer.json`` says, so the tokenizer behaves identically
    whether it is loaded as ``Qwen2Tokenizer`` (qwen2) or as ``TokenizersBackend`` (llama).
    Characters outside ``charset`` have no token.
    """
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
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )


def build_base_model(
    out_dir: Path,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    charset: str = DEFAULT_CHARSET,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised ``arch`` model and its tokenizer to ``out_dir``; verify reload."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(charset)
    if hidden_size % heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by heads={heads}")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_cls(**common)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    reloaded, reloaded_tok = load_policy(out_dir)
    probe = charset
    ids = tokenizer(probe)["input_ids"]
    if reloaded_tok(probe)["input_ids"] != ids or reloaded_tok.decode(ids, skip_special_tokens=True) != probe:
        raise RuntimeError(f"tokenizer in {out_dir} does not round-trip through from_pretrained")
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, reloaded.state_dict()[name]):
            raise RuntimeError(f"weight {name} in {out_dir} does not round-trip")
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built %s base model (%d parameters, vocab %d) in %s", arch, n_params, len(tokenizer), out_dir)
    return out_dir


def load_policy(
    model_dir: Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load a causal LM and its tokenizer with ``from_pretrained`` from a local directory."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(device), tokenizer
