"""Small Hugging Face checkpoints built from scratch, for examples and tests (no downloads).

``build_checkpoint`` writes a randomly initialised causal LM of any architecture transformers
knows (``model_type``: qwen2, qwen3, llama, mistral, ...; with ``num_experts`` a mixture of experts:
qwen3_moe, qwen2_moe, olmoe, mixtral, ...) with a given tokenizer, through ``save_pretrained``, and
checks that it reloads bit for bit with ``from_pretrained``. The result is
an ordinary checkpoint directory: every part of rlbus loads it as it loads a published one.
``train_bpe_tokenizer`` trains a byte-level BPE tokenizer on a corpus with the ``tokenizers``
library, optionally with a ChatML chat template (``<|im_start|>role ... <|im_end|>``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message['role'] }}\n{{ message['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
"""ChatML, as Qwen and many chat checkpoints use; the generation prompt opens the assistant turn."""


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, chat_template: bool = True):
    """A byte-level BPE tokenizer trained on ``texts``; ``<|im_end|>`` ends a turn and is the EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD, padding_side="left",
                                        additional_special_tokens=[IM_START])
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_checkpoint(
    out_dir: Path,
    tokenizer,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    vocab_size: int | None = None,
    tie_embeddings: bool = False,
    num_experts: int | None = None,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool | None = None,
) -> Path:
    """Write a randomly initialised ``arch`` causal LM with ``tokenizer`` to ``out_dir``; verify reload.
    ``vocab_size``: the embedding's rows, at least the tokenizer's (real checkpoints pad it, Qwen's to
    151,936); ``tie_embeddings``: the LM head shares the input embedding.

    A mixture of experts (an ``arch`` such as qwen3_moe, qwen2_moe, olmoe, mixtral): ``num_experts`` per
    MoE layer (None: a dense model), ``top_k`` of them per token, each expert's hidden width
    ``moe_intermediate_size`` (default ``intermediate_size``; also the shared expert's where the
    architecture has one), ``norm_topk_prob`` (None: the architecture's default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model import load_policy
    from producers.engines.moe import routing_shape

    if hidden_size % heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by heads={heads}")
    kv_heads = kv_heads or heads
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    intermediate_size = intermediate_size or 4 * hidden_size
    try:
        defaults = AutoConfig.for_model(arch)
    except ValueError as exc:
        raise ValueError(f"arch {arch!r}: not a model type transformers knows ({exc})") from None
    fields = dict(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_embeddings,
    )
    expert_size = moe_intermediate_size or intermediate_size
    fields.update(_moe_options(defaults, num_experts, top_k, expert_size, norm_topk_prob))
    config = AutoConfig.for_model(arch, **fields)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if num_experts is not None and routing_shape(model) is None:  # an MoE router rlbus does not know is refused there
        raise ValueError(f"arch {arch!r} built no mixture-of-experts layer from num_experts={num_experts}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    reloaded, reloaded_tok = load_policy(out_dir, device="cpu")  # compared with the model built here, on the CPU
    probe = "12+34= The answer"
    ids = tokenizer(probe)["input_ids"]
    if reloaded_tok(probe)["input_ids"] != ids:
        raise RuntimeError(f"tokenizer in {out_dir} does not round-trip through from_pretrained")
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, reloaded.state_dict()[name]):
            raise RuntimeError(f"weight {name} in {out_dir} does not round-trip")
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built %s checkpoint (%d parameters, vocab %d) in %s", arch, n_params, config.vocab_size, out_dir)
    return out_dir


def _moe_options(defaults, num_experts: int | None, top_k: int, expert_size: int, norm_topk_prob: bool | None) -> dict:
    """The config fields of a mixture of experts whose architecture's default config is ``defaults``
    (none for a dense model)."""
    if num_experts is None:
        return {}
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be within 1..num_experts={num_experts}")
    key = next((k for k in ("num_experts", "num_local_experts") if hasattr(defaults, k)), None)
    if key is None:
        raise ValueError(f"arch {defaults.model_type!r} has no num_experts: not a mixture-of-experts architecture "
                         "(try qwen3_moe, qwen2_moe, olmoe or mixtral)")
    options = {key: num_experts, "num_experts_per_tok": top_k}
    # The experts' width: its own field where the architecture has one, else intermediate_size (olmoe, mixtral).
    sized = [k for k in ("moe_intermediate_size", "shared_expert_intermediate_size") if hasattr(defaults, k)]
    options.update(dict.fromkeys(sized or ["intermediate_size"], expert_size))
    if norm_topk_prob is not None:
        if not hasattr(defaults, "norm_topk_prob"):
            raise ValueError(f"arch {defaults.model_type!r} has no norm_topk_prob option (its router always "
                             "renormalises the same way)")
        options["norm_topk_prob"] = norm_topk_prob
    return options
