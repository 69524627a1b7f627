"""Speed options keep training exact: regional torch.compile and diffusers' attention backends roll out what eager
rolls out and start each round on-policy (ratio 1 through the training forward, with gradients); lossy ones are
refused."""

import pytest
from conftest import LORA_TARGETS, PROMPTS, max_ratio_deviation, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer

ROWS = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]


def _trainer(tiny_model_dir, tmp_path, kind="flux", **overrides):
    args = tiny_grpo_config(tmp_path / str(len(overrides)), **overrides)
    peft = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    dataset = Dataset.from_dict({"prompt": PROMPTS[:8]})
    return DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=dataset, peft_config=peft)


@pytest.mark.parametrize(
    "overrides",
    [
        # aot_eager: dynamo and AOTAutograd's separate grad and no-grad graphs, without inductor's code generation
        # (measured with inductor on this CPU too: rollouts 4.8e-7 from eager, ratio deviation 0).
        {"torch_compile": True, "torch_compile_backend": "aot_eager"},
        {"attention_backend": "_native_math"},
    ],
    ids=["torch_compile", "attention_backend"],
)
def test_speed_option_rolls_out_like_eager_and_stays_on_policy(tiny_model_dir, tmp_path, overrides):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry.get_active_backend()[0]
    eager, fast = _trainer(tiny_model_dir, tmp_path), _trainer(tiny_model_dir, tmp_path, **overrides)
    # The backend is the trained model's alone: diffusers' process-wide one (what every other model runs) is unchanged.
    assert _AttentionBackendRegistry.get_active_backend()[0] == active
    eager._generate_and_score(ROWS)
    fast._generate_and_score(ROWS)
    assert fast.flops.take() == pytest.approx(eager.flops.take())  # the rollouts' FLOPs, counted alike
    assert (fast._rollout["latents"] - eager._rollout["latents"]).abs().max() < 1e-5
    assert (fast._rollout["log_probs"] - eager._rollout["log_probs"]).abs().max() < 1e-5
    assert max_ratio_deviation(fast, grad=True) < 1e-6  # through the training forward, with gradients
    if "torch_compile" in overrides:  # compiled in place, block by block
        assert all(block._compiled_call_impl is not None for block in fast.policy.denoiser.transformer_blocks)


def test_unusable_speed_options_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="attention_backend must be one of diffusers' backends"):
        DanceGRPOConfig(output_dir=str(tmp_path), attention_backend="fastest", use_cpu=True)
    with pytest.raises(ValueError, match="call PyTorch's SDPA directly"):  # SD3's processors bypass the dispatcher
        _trainer(tiny_model_dir, tmp_path, kind="sd3", attention_backend="native", guidance_scale=4.0)


def test_lossy_rollout_cache_is_refused_for_ratio_losses(tiny_model_dir, tmp_path):
    from diffusers import FirstBlockCacheConfig

    from trl_dance.trainer.diffusion_trainer import load_pipeline

    args = tiny_grpo_config(tmp_path)
    pipeline = load_pipeline(tiny_model_dir("flux"), args)
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    with pytest.raises(ValueError, match="cache enabled.*DanceGRPOTrainer's likelihood ratio"):
        DanceGRPOTrainer(pipeline, "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))


def test_cudnn_attention_is_off_unless_asked_for(tiny_model_dir, tmp_path):
    """PyTorch's cuDNN SDPA kernel made an illegal memory access in FLUX.1-dev's first training backward on an H200
    (torch 2.11, cuDNN 9.19): trainers turn it off for the process unless `cudnn_attention=True`."""
    import torch

    try:
        _trainer(tiny_model_dir, tmp_path)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        _trainer(tiny_model_dir, tmp_path, cudnn_attention=True)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default, for the tests after this one


def test_auto_attention_backend_and_compile_resolve_per_device(tiny_model_dir, tmp_path, monkeypatch):
    """`attention_backend="auto"` is cuDNN's kernel only on a Hopper-or-newer CUDA device, for a dispatcher model
    without text masks; `torch_compile=None` compiles only on an unsharded CUDA run."""
    import torch

    from trl_dance.trainer.speed import resolve_attention_backend, resolve_torch_compile

    flux = _trainer(tiny_model_dir, tmp_path).policy.denoiser
    sd3 = _trainer(tiny_model_dir, tmp_path, kind="sd3", guidance_scale=4.0).policy.denoiser
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attention_backend("auto", flux, cpu, masks_text=False) is None
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for capability, want in (((9, 0), "_native_cudnn"), ((10, 0), "_native_cudnn"), ((8, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert resolve_attention_backend("auto", flux, cuda, masks_text=False) == want
    assert resolve_attention_backend("auto", flux, cuda, masks_text=True) is None  # masked: cuDNN's NaN bug
    assert resolve_attention_backend("auto", sd3, cuda, masks_text=False) is None  # SDPA called directly
    assert resolve_attention_backend("native", flux, cuda, masks_text=False) == "native"
    assert resolve_attention_backend(None, flux, cuda, masks_text=False) is None
    assert resolve_torch_compile(None, cuda, None) and not resolve_torch_compile(None, cpu, None)
    assert not resolve_torch_compile(None, cuda, "FSDP") and not resolve_torch_compile(False, cuda, None)
    assert resolve_torch_compile(True, cpu, None)


def test_compiled_blocks_stay_whole_through_training(tiny_model_dir, tmp_path, monkeypatch):
    """Compiled blocks run whole in every phase: the FLOP counter's first call with gradients (which hooks every
    op) runs eager, so no block is traced with its hooks, which dynamo keeps as graph breaks for the whole run once the
    hooks are gone (it does not guard on hooks: a tiny FLUX's round ran 532 graphs instead of 32). Each denoiser call
    then runs one graph per block (twice with gradients: activation checkpointing's recomputation), and the FLOPs
    logged are the eager run's."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    from trl_dance.trainer import speed

    graph_calls = [0]

    def counting(graph, example_inputs, **kwargs):
        compiled = lookup_backend("aot_eager")(graph, example_inputs, **kwargs)

        def run(*args):
            graph_calls[0] += 1
            return compiled(*args)

        return run

    compile_regions = speed.compile_regions
    monkeypatch.setattr(
        speed, "compile_regions", lambda model, _, *options: compile_regions(model, counting, *options)
    )
    torch._dynamo.reset()  # no graphs from earlier tests of this process
    counters.clear()
    overrides = {"max_steps": 2, "activation_checkpointing": True}
    compiled = _trainer(tiny_model_dir, tmp_path, torch_compile=True, torch_compile_backend="aot_eager", **overrides)
    eager = _trainer(tiny_model_dir, tmp_path, **overrides)
    blocks = [m for m in compiled.policy.denoiser.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(blocks) >= 2 and compiled.policy.denoiser._compiled_call_impl is None  # block by block

    calls = []  # per round: (graph calls, denoiser calls, of which with gradients)
    compiled.policy.denoiser.register_forward_pre_hook(lambda *_: calls[-1].__setitem__(1, calls[-1][1] + 1))
    compiled.policy.denoiser.register_forward_pre_hook(
        lambda *_: calls[-1].__setitem__(2, calls[-1][2] + torch.is_grad_enabled())
    )

    class Rounds(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            calls.append([-graph_calls[0], 0, 0])

        def on_step_end(self, args, state, control, **kwargs):
            calls[-1][0] += graph_calls[0]

    compiled.add_callback(Rounds())
    compiled.train()
    eager.train()
    assert not counters["graph_break"], list(counters["graph_break"])
    graphs, denoiser_calls, with_grad = calls[-1]  # the second round: compiled from its start
    assert with_grad > 0 and graphs == len(blocks) * (denoiser_calls + with_grad)
    logged = [
        [log["perf/denoiser_tflops"] for log in t.state.log_history if "perf/denoiser_tflops" in log]
        for t in (compiled, eager)
    ]
    assert logged[0] == pytest.approx(logged[1])


def test_compile_regions_leaves_the_root_eager():
    """Without declared repeated blocks: the longest child list of one class is compiled block by block, else each
    child; never the root, whose hooks (the FLOP counter's) must stay out of compiled code."""
    import torch

    from trl_dance.trainer.speed import compile_regions

    def compiled(module):
        return getattr(module, "_compiled_call_impl", None) is not None

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 4)
            self.mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4)])
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    model = Blocks()
    compile_regions(model, "eager", None)
    assert [compiled(m) for m in (model, model.embed, *model.mixed, *model.blocks)] == [False] * 5 + [True] * 2
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    compile_regions(plain, "eager", None)
    assert not compiled(plain) and all(compiled(child) for child in plain)
    assert torch.equal(plain(torch.ones(1, 4)), torch.nn.functional.gelu(plain[0](torch.ones(1, 4))))


def test_spinning_openmp_threads_are_named_once_with_the_fix(monkeypatch, caplog):
    """torch loaded before trl_dance without OMP_WAIT_POLICY: a CPU trainer says how to stop its threads spinning
    (benchmarks/python_api_threads.py measures the cost); `import trl_dance` first sets PASSIVE itself."""
    import os
    import subprocess
    import sys

    import trl_dance
    from trl_dance.trainer import diffusion_trainer

    monkeypatch.setattr(trl_dance._threads, "OMP_SPINS", True)
    monkeypatch.delattr(diffusion_trainer.warn_if_threads_spin, "said", raising=False)
    with caplog.at_level("WARNING", logger="trl_dance.trainer.diffusion_trainer"):
        diffusion_trainer.warn_if_threads_spin()
        diffusion_trainer.warn_if_threads_spin()
    assert [r.getMessage().count("Export OMP_WAIT_POLICY=PASSIVE") for r in caplog.records] == [1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = "import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import trl_dance; print(os.environ['OMP_WAIT_POLICY'])"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout == "PASSIVE\n"
