"""The docs run as written: every Python example of the README and the docs site, every command of the getting-started
page, and a strict build of the site (the README stays a front page of at most 300 lines)."""

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from trl_dance.testing import save_tiny_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True))]


def _blocks(path: str, language: str) -> list[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return re.findall(rf"```{language}\n(.*?)```", handle.read(), flags=re.S)


def test_python_examples_run(tmp_path, monkeypatch):
    """Each distinct example runs (from a folder holding outputs/tiny-flux, as after the demo): DanceGRPO with a custom
    reward and DiffusionNFT train and save a LoRA; the register_policy example makes its pipeline class train with its
    policy; the rewards page's functions (ours, TRL's naming, a column by name) score a batch."""
    from trl_dance.policies import SamplerSettings, make_policy
    from trl_dance.rewards import score_images

    blocks = {}
    for path in PAGES:  # README's example is concepts.md's: each distinct block runs once
        for block in _blocks(path, "python"):
            blocks.setdefault(block, path)
    assert sorted(set(blocks.values())) == [
        "README.md", "docs/add-a-model-family.md", "docs/methods/nft.md", "docs/rewards.md"
    ] and len(blocks) == 5  # fmt: skip
    monkeypatch.chdir(tmp_path)
    save_tiny_pipeline("flux", "outputs/tiny-flux")
    trainers, namespaces = [], {}
    for block, path in blocks.items():
        namespace = namespaces.setdefault(path, {})  # a page's blocks share one namespace
        exec(compile(block, path, "exec"), namespace)
        if "trainer" in namespace:
            trainers.append(namespace["trainer"])
    pipeline = namespaces["docs/add-a-model-family.md"]["MyFluxPipeline"].from_pretrained("outputs/tiny-flux")
    policy = make_policy(pipeline, SamplerSettings(height=32, width=32))
    assert type(policy) is namespaces["docs/add-a-model-family.md"]["MyFluxPolicy"]
    grpo, nft = trainers
    assert grpo.reward_names == ["redness", "brightness"]
    assert any("rewards/redness/mean" in entry for entry in grpo.state.log_history)
    assert nft.state.global_step == 3
    for name in ("readme-example", "nft-example"):
        assert (tmp_path / "outputs" / name / "pytorch_lora_weights.safetensors").exists()
    rewards = namespaces["docs/rewards.md"]
    funcs = [rewards["redness"], rewards["sharpness"], rewards["style_match"]]
    scores = score_images(funcs, ["a", "b"], torch.rand(2, 3, 8, 8), {"style": ["bright", "dark"]})
    assert scores.shape == (2, 3) and scores.isfinite().all() and scores[1, 2] == 0
    audio = torch.full((2, 2, 160), 0.1) * torch.tensor([1.0, 0.01]).view(2, 1, 1)
    loud = score_images([rewards["loudness"]], ["a", "b"], torch.rand(2, 5, 3, 8, 8), {}, audio=(audio, 16000))
    torch.testing.assert_close(loud.flatten(), torch.tensor([-20.0, -60.0]))


def test_scripts_run_in_the_environment_setup_made():
    """demo.sh and test.sh call the programs of the environment setup_env.sh made: ``$TRL_DANCE_VENV`` when set."""
    for name in ("demo.sh", "test.sh"):
        with open(os.path.join(ROOT, "scripts", name)) as handle:
            text = handle.read()
        assert 'venv="${TRL_DANCE_VENV:-.venv}"' in text and ".venv/bin" not in text, name


def test_getting_started_commands_run(tmp_path):
    """The setup commands are the README's two (the second is the suite CI runs); the first run's commands run as
    written, in order, from a working directory holding the repository's recipes and .venv."""
    setup, first_run = _blocks("docs/getting-started.md", "bash")
    assert setup == _blocks("README.md", "bash")[0]
    commands = [line.split("#")[0].strip() for line in setup.splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        assert "\nbash scripts/test.sh\n" in handle.read()
    for name in (".venv", "recipes"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", first_run],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "outputs" / "first-run" / "pytorch_lora_weights.safetensors").exists()
    assert (tmp_path / "outputs" / "first-eval" / "results.md").read_text().startswith("| model |")
    assert "- trl-dance version: " in result.stdout


def test_docs_build_strictly_and_the_readme_is_a_front_page(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        assert len(handle.read().splitlines()) <= 300
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    pages = glob.glob("**/index.html", root_dir=tmp_path / "site", recursive=True)
    assert len(pages) >= 20 and (tmp_path / "site" / "reference" / "configs" / "index.html").is_file()
    assert "dppo_kl_threshold" in (tmp_path / "site" / "reference" / "configs" / "index.html").read_text()


def test_architecture_layout_names_every_module():
    """docs/architecture.md's layout block stays true: it names every module and package of trl_dance/ and every
    module of trl_dance/policies/ but the families' (those are docs/models.md's)."""
    root = Path(os.path.dirname(os.path.abspath(__file__))).parent
    text = (root / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout") :]
    package = root / "trl_dance"
    names = [f"trl_dance/{p.name}" + ("/" if p.is_dir() else "") for p in package.iterdir()]
    missing = [name for name in names if not name.endswith(("__init__.py", "__pycache__/")) and name not in layout]
    for path in (package / "policies").glob("*.py"):
        family = re.search(r"^class \w+Policy\(", path.read_text(), re.MULTILINE)
        if path.stem != "__init__" and not family and path.name not in layout:
            missing.append(path.name)
    assert not missing, f"docs/architecture.md's layout does not name {missing}"
