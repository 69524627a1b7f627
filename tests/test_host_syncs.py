"""No host-device synchronisation inside the denoising loop or a training micro-step.

On an accelerator every read of a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
boolean-mask indexing, ...) waits for the queued kernels, leaving the GPU idle while the host prepares the next
step. On the CPU such reads are free, so the tests watch for the operations themselves, through a
``TorchFunctionMode`` that sees every tensor method call.
"""

import traceback
from collections import Counter

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, family_overrides, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig
from torch.overrides import TorchFunctionMode

from trl_dance import DanceGRPOTrainer, DiffusionDPOConfig, DiffusionDPOTrainer
from trl_dance.policies import SamplerSettings, make_policy
from trl_dance.testing import tiny_condition_images, tiny_preference_dataset

_READS = {"item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts tensor operations that read device values on the host, by operation and calling line."""

    def __init__(self):
        super().__init__()
        self.reads: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        boolean_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flatten(args[1:])
        )
        if name in _READS or boolean_index:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            self.reads[f"{name} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _flatten(values):
    for value in values:
        if isinstance(value, (tuple, list)):
            yield from _flatten(value)
        else:
            yield value


def test_the_probe_sees_host_reads():
    x = torch.ones(3)
    with HostReads() as probe:
        x.sum().item()
        bool(x.sum() > 0)
        x[x > 0]
        x.tolist()
    assert sum(probe.reads.values()) == 4, probe.reads


def _lora():
    return LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS)


@pytest.mark.parametrize(
    ("kind", "guidance", "extra"),
    [
        ("flux", 3.5, {}),
        ("flux2", 4.0, {}),  # position ids built once per shape, host-side
        ("sdxl", 4.0, {}),
        ("qwen-image", 4.0, {}),  # true CFG with the masked negative prompt
        ("hunyuan-video", 6.0, {}),  # embedded guidance, masked Llama embeddings
        ("skyreels-i2v", 6.0, {}),  # true CFG, image latents as channels
        ("wan", 5.0, {}),
        # a frozen expert's steps; 8 videos x 3 low-noise steps / 8 = 3 micro-batches per round
        ("wan22", 5.0, {"train_expert": "low_noise", "timestep_fraction": 0.6, "gradient_accumulation_steps": 3}),
        ("wan22-5b-i2v", 5.0, {}),  # per-token timesteps, the given first frame
    ],
)
def test_grpo_denoising_loop_and_micro_step_never_read_the_device(tiny_model_dir, tmp_path, kind, guidance, extra):
    images = {"image": tiny_condition_images(2)} if kind.endswith("i2v") else {}
    trainer = DanceGRPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=tiny_grpo_config(tmp_path, guidance_scale=guidance, **extra, **family_overrides(kind)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2], **images}),
        peft_config=_lora(),
    )
    rows = [dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)]
    trainer._generate_and_score(rows)
    cond = trainer.policy.encode_prompts(PROMPTS[:2], **images)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    with HostReads() as probe:
        trainer.sample(PROMPTS[:2], generators, cond=cond)
        inputs = trainer._microbatch(trainer._microbatches[0])
        trainer.compute_loss(trainer.model, inputs).backward()
    assert not probe.reads, probe.reads
    # The metrics recorded meanwhile are read once, at log time.
    logs = {}
    trainer.log(logs)
    assert logs["ratio/mean"] == pytest.approx(1.0, abs=1e-5) and "reward" in logs


def test_dpo_micro_step_never_reads_the_device(tiny_model_dir, tmp_path):
    data = tiny_preference_dataset("sd", count=4)
    args = DiffusionDPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", resolution=32, max_sequence_length=16
    )
    trainer = DiffusionDPOTrainer(tiny_model_dir("sd"), args=args, train_dataset=data, peft_config=_lora())
    batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in range(4)]))
    with HostReads() as probe:
        trainer.compute_loss(trainer.model, batch).backward()
    assert not probe.reads, probe.reads


def test_a_noiseless_trainable_step_is_refused_once_at_construction(tiny_model_dir):
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dir("flux"))
    policy = make_policy(pipeline, SamplerSettings(num_inference_steps=4, height=32, width=32, eta=0.0))
    with pytest.raises(ValueError, match=r"steps \[0, 1, 2\] of the 4-step schedule have zero standard deviation"):
        policy.check_schedule()
    # CPS's last step lands on sigma = 0 with zero noise; it is never trained, so the schedule is valid.
    make_policy(pipeline, SamplerSettings(num_inference_steps=4, height=32, width=32, sde_type="cps")).check_schedule()


def test_windowed_branched_flash_rollout_and_guard_step_never_read_the_device(tiny_model_dir, tmp_path):
    """A Flow-GRPO-Fast window reached by a branched prefix, MixGRPO-Flash's DPM-Solver++ after it, and a GRPO-Guard
    micro-step."""
    extra = {"sde_window_size": 2, "sde_window_range": [1, 4], "branching": True, "post_window_step_ratio": 0.5}
    extra |= {"post_window_solver": "dpm_solver++", "ratio_normalization": True, "step_reweighting": True}
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=tiny_grpo_config(tmp_path, sde_type="flow_grpo", eta=0.7, gradient_accumulation_steps=2, **extra),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
        peft_config=_lora(),
    )
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    cond = trainer.policy.encode_prompts([PROMPTS[0]] * 4)
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    plan, groups = trainer.rollout_plan(1), [0, 0, 1, 1]
    noise = trainer.policy.initial_noise(generators[:1]).expand(4, -1, -1)
    assert plan.sde_start >= 1 and plan.post_window_sigmas is not None
    with HostReads() as probe:
        trainer.sample(PROMPTS[:4], generators, cond=cond, initial_noise=noise, plan=plan, groups=groups)
        trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0])).backward()
    assert not probe.reads, probe.reads


@pytest.mark.parametrize("loss_type", ["nft", "awm", "dgpo"])
def test_forward_process_rollout_and_micro_step_never_read_the_device(tiny_model_dir, tmp_path, loss_type):
    from conftest import tiny_online_values

    from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer

    values = tiny_online_values(tmp_path) | {"timestep_fraction": 0.5, "gradient_accumulation_steps": 3}
    values |= {"loss_type": loss_type, "rollout_solver": "dpm_solver++"}
    trainer = DiffusionNFTTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=DiffusionNFTConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
        peft_config=_lora(),
    )
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    cond = trainer.policy.encode_prompts(PROMPTS[:2])
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    with HostReads() as probe:
        trainer.sample(PROMPTS[:2], generators, model=trainer._rollout_model(), cond=cond)
        trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0])).backward()
    assert not probe.reads, probe.reads
