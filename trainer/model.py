"""Loading a policy: a Hugging Face causal LM and its tokenizer, from a local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str) -> str:
    """'auto': cuda when a GPU is present, else cpu; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_policy(
    model_dir: Path, dtype: str | torch.dtype = "float32", device: str = "auto"
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer with ``from_pretrained`` from a local directory, onto
    ``device`` ('auto': cuda when present, else cpu)."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(resolve_device(device)), tokenizer


class CheckpointError(ValueError):
    """A model directory that is not a loadable causal-LM checkpoint; the message says what is missing."""

    retriable = False


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_checkpoint(model_dir: str | Path) -> str:
    """Check that ``model_dir`` holds a Hugging Face causal-LM checkpoint (config, weights,
    tokenizer) without loading the weights; returns its ``model_type``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model.path {path} is not a directory; give a Hugging Face checkpoint directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model.path {path} has no config.json: not a Hugging Face checkpoint (save one with "
                              "save_pretrained)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError for unknown or broken configs
        raise CheckpointError(f"model.path {path}: config.json cannot be read by transformers ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(f"model.path {path}: model_type {config.model_type!r} is not a causal LM that "
                              "transformers' AutoModelForCausalLM loads")
    if not any((path / name).is_file() for name in WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise CheckpointError(f"model.path {path} holds no weights (one of {', '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CheckpointError(f"model.path {path} holds no tokenizer (tokenizer.json or tokenizer_config.json); save "
                              "the tokenizer with save_pretrained into the same directory")
    return config.model_type
