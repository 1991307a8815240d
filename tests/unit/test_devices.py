"""Every path that touches a model takes its device from the configuration ("auto": the GPU when
there is one): loading, the trainer and its value model and reference, prepare's warm-up, held-out
scoring and evaluation. No such path names the CPU itself, but for the reasons listed here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from producers import role as producer_role
from producers.engines.torch_engine import TorchEngine
from trainer import learner, model, value, warmup
from rlbus.examples import addition

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "producers", "consumers", "trainer", "weightstore", "rlbus")
ALLOWED = {
    # where "auto" resolves to the CPU on a machine without a GPU
    ("trainer/model.py", "resolve_device"),
    ("producers/engines/torch_engine.py", "__init__"),
    # ranks on CPUs (gloo); FSDP2 on GPUs uses one GPU a rank
    ("trainer/ranks.py", "join_ranks"),
    # weights leave the device to be encoded and published, as bytes do
    ("trainer/learner.py", "weights"),
    ("weightstore/publish.py", "cast"),
    ("weightstore/patch/codec.py", "tensor_bits"),
    # a vLLM weight update is written to shared memory for vLLM's worker to load
    ("producers/engines/vllm_engine.py", "_checked"),
    # how often the decoding loop reads the device: every step on a CPU, where a read costs nothing
    ("producers/engines/torch_engine.py", "_run"),
    # the scratch builder checks the file it wrote against the model it built on the CPU
    ("rlbus/examples/scratch.py", "build_checkpoint"),
    # a label stamped on trajectory groups, not a device
    ("producers/config.py", "WorkerConfig"),
    ("broker/schema.py", "TrajectoryHeader"),
}


def _cpu_literals() -> set[tuple[str, str]]:
    """(file, enclosing function or class) of every "cpu" string in the packages."""
    found = set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value == "cpu":
                    inner = [s for s in scopes if s.lineno <= node.lineno <= (s.end_lineno or s.lineno)]
                    name = min(inner, key=lambda s: (s.end_lineno or s.lineno) - s.lineno).name if inner else "<module>"
                    found.add((str(path.relative_to(REPO)), name))
    return found


def test_no_model_path_names_the_cpu_but_the_listed_ones() -> None:
    unexpected = _cpu_literals() - ALLOWED
    assert not unexpected, f"these name the CPU where a configured device belongs: {sorted(unexpected)}"


def test_model_loaders_default_to_the_configured_device_and_roles_pass_theirs() -> None:
    for fn in (model.load_policy, value.load_value_model, TorchEngine.__init__, warmup.supervised_warmup,
               producer_role.evaluate, producer_role.prepare_heldout, producer_role.build_role_rows, addition.prepare):
        assert inspect.signature(fn).parameters["device"].default == "auto", fn.__qualname__
    # The learner builds the policy, the value model and the reference on the device it is given.
    source = inspect.getsource(learner.build_learner)
    assert 'load_policy(model_dir, "float32", device=str(device))' in source
    assert "Critic.build(config, model_dir, str(device))" in source
    # The roles hand the configured devices down.
    roles = (REPO / "rlbus" / "roles.py").read_text()
    for call in ("device=cfg.policy().trainer.device", "device=cfg.policy(name).trainer.device",
                 "device=cfg.engine.device"):
        assert call in roles, call
