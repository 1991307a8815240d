"""The learner's weights for publication: the state dict's names and values, cast as the publisher
casts them, tied weights under both names, publishable as an anchor and then as a delta."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer
from trainer.config import TrainerConfig
from trainer.learner import build_learner
from weightstore.config import WeightsConfig
from weightstore.inspect import load_version
from weightstore.objectstore import LocalDirStore
from weightstore.publish import WeightPublisher


def test_weights_of_a_tied_model_publish_as_the_state_dict(tmp_path: Path) -> None:
    tok = train_bpe_tokenizer(["1 plus 2 is 3", "4 plus 5 is 9"] * 10, vocab_size=300)
    model_dir = build_checkpoint(tmp_path / "m", tok, arch="qwen3", hidden_size=32, layers=1, heads=2,
                                 tie_embeddings=True)
    learner, _ = build_learner(TrainerConfig(device="cpu"), model_dir, temperature=1.0, device=torch.device("cpu"))
    store = LocalDirStore(Path(tempfile.mkdtemp(dir=tmp_path)))
    publisher = WeightPublisher(store, "main", WeightsConfig())
    weights = learner.weights(publisher.dtype)
    expected = publisher.cast(learner.lm.state_dict())
    assert weights.keys() == expected.keys() and {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()
    assert publisher.publish(0, weights, owned=True).kind == "anchor"
    with torch.no_grad():
        learner.lm.get_input_embeddings().weight.add_(0.5)
    assert publisher.publish(1, learner.weights(publisher.dtype), owned=True).kind == "delta"
    stored = load_version(store, "main", 1)
    assert torch.equal(stored["lm_head.weight"], learner.weights(publisher.dtype)["lm_head.weight"])
