"""The README's Python example runs as written (from a folder holding outputs/tiny-flux, as after the demo)."""

import os
import re

from trl_dance.testing import save_tiny_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """The examples run as written: DanceGRPO with a custom reward and DiffusionNFT train and save a LoRA; the
    register_policy example makes its pipeline class train with its policy."""
    from trl_dance.policies import SamplerSettings, make_policy

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    save_tiny_pipeline("flux", "outputs/tiny-flux")
    trainers = []
    for block in blocks:
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)
        if "trainer" in namespace:
            trainers.append(namespace["trainer"])
        else:
            pipeline = namespace["MyFluxPipeline"].from_pretrained("outputs/tiny-flux")
            policy = make_policy(pipeline, SamplerSettings(height=32, width=32))
            assert type(policy) is namespace["MyFluxPolicy"]
    assert trainers[0].reward_names == ["redness", "brightness"]
    assert any("rewards/redness/mean" in entry for entry in trainers[0].state.log_history)
    assert trainers[1].state.global_step == 3
    for name in ("readme-example", "nft-example"):
        assert (tmp_path / "outputs" / name / "pytorch_lora_weights.safetensors").exists()
