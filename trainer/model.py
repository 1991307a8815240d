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


def load_policy(
    model_dir: Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer with ``from_pretrained`` from a local directory."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(device), tokenizer
