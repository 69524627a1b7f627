"""The README's Python example runs as written (from a folder holding outputs/tiny-flux, as after the demo)."""

import os
import re

from trl_dance.testing import save_tiny_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_example_runs(tmp_path, monkeypatch):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    save_tiny_pipeline("flux", "outputs/tiny-flux")
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.reward_names == ["redness", "brightness"]
    assert any("rewards/redness/mean" in entry for entry in trainer.state.log_history)
    assert (tmp_path / "outputs" / "readme-example" / "pytorch_lora_weights.safetensors").exists()
