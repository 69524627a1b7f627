"""Run by tests/test_preemption.py, as one process or under `accelerate launch`: a tiny FLUX LoRA GRPO run of 6
updates (Adam, an update per micro-batch: 5 updates a round, so the 6 span two rounds) three times in one process:
uninterrupted; signalled (`argv[3]`, e.g. SIGTERM) during its 3rd update, inside the first round, on rank 0 only (so
the ranks must agree to stop), twice at once as a launcher forwarding it would;
resumed from the latest checkpoint. The main process
writes the trained parameters of the first and the last (full.pt, resumed.pt) and the step the signalled run stopped at
and the checkpoints it left (result.json) to argv[2]. With argv[4] == "twice", a second signal follows after the repeat
window instead and the process is expected to die of it; with SIGKILL, rank 1 dies during the 2nd update; with argv[4] ==
"grace", the signalled update takes longer than preemption_grace_s; with SAVEFAIL (no signal), rank 0's share of the first
checkpoint fails as on a full disk."""

import errno
import json
import os
import signal
import sys
import time

import torch
from conftest import tiny_grpo_config  # (this script's folder, tests/, is on the path)
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from trl_dance import DanceGRPOTrainer
from trl_dance.trainer.preemption import REPEAT_WINDOW_S

model_dir, output_dir, signal_name = sys.argv[1:4]
twice = len(sys.argv) > 4 and sys.argv[4] == "twice"
torch.set_num_threads(1)
world = int(os.environ.get("WORLD_SIZE", "1"))


class SignalDuringStep(TrainerCallback):
    """Sends the signal to this process (rank 0 only) as the given update starts."""

    def __init__(self, step: int, times: int):
        self.step, self.times = step, times

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1 and int(os.environ.get("RANK", "0")) == 0:
            for repeat in range(self.times):
                if repeat:  # a second request, after the window in which a repeat is the same one
                    time.sleep(REPEAT_WINDOW_S + 0.5)
                os.kill(os.getpid(), getattr(signal, signal_name))


def trainer(name: str, **overrides) -> DanceGRPOTrainer:
    args = tiny_grpo_config(  # 5 micro-batches of 8 // world transitions a round, an update each
        os.path.join(output_dir, name), per_device_train_batch_size=8 // world, gradient_accumulation_steps=1,
        max_steps=6, learning_rate=1e-2, logging_steps=10, seed=5, **overrides,
    )  # fmt: skip
    peft = LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights="gaussian"
    )
    prompts = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    return DanceGRPOTrainer(model_dir, "brightness", args=args, train_dataset=prompts, peft_config=peft)


def save(run: DanceGRPOTrainer, name: str) -> None:
    if run.accelerator.is_main_process:
        model = run.accelerator.unwrap_model(run.model)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, name)


if signal_name == "SIGKILL":  # a process that dies: rank 1 kills itself as its 2nd update starts
    dying = trainer("dying")

    class Die(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and int(os.environ.get("RANK", "0")) == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    dying.add_callback(Die())
    dying.train()
    sys.exit(3)  # not reached on either rank: rank 0's next collective fails, or its launcher ends it

if len(sys.argv) > 4 and sys.argv[4] == "grace":  # an update slower than preemption_grace_s after the signal
    slow = trainer("slow", preemption_grace_s=1.0)

    class SlowUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                time.sleep(30)  # the grace ends in this update

    slow.add_callback(SignalDuringStep(3, times=1))
    slow.add_callback(SlowUpdate())
    slow.train()
    sys.exit(3)  # not reached: the grace's end exits

if signal_name == "SAVEFAIL":  # rank 0's share of the first checkpoint fails (a full disk); rank 1's succeeds
    failing = trainer("savefail", save_strategy="steps", save_steps=2)
    if int(os.environ.get("RANK", "0")) == 0:

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        failing._write_weights = full_disk
    failing.train()
    sys.exit(3)  # not reached on either rank: both raise

if twice:
    signalled = trainer("twice")
    signalled.add_callback(SignalDuringStep(3, times=2))
    signalled.train()
    sys.exit(3)  # not reached: the second signal ends the process

full = trainer("full")
full.train()
save(full, os.path.join(output_dir, "full.pt"))

signalled = trainer("preempted")
signalled.add_callback(SignalDuringStep(3, times=1))
signalled.add_callback(SignalDuringStep(3, times=1))  # the same request again at once (a launcher forwarding it)
signalled.train()
stopped = signalled.state.global_step
folder = os.path.join(output_dir, "preempted")
checkpoints = sorted(name for name in os.listdir(folder) if name.startswith("checkpoint-"))

resumed = trainer("preempted")
resumed.train(resume_from_checkpoint=True)
save(resumed, os.path.join(output_dir, "resumed.pt"))
if resumed.accelerator.is_main_process:
    with open(os.path.join(output_dir, "result.json"), "w") as handle:
        json.dump({"stopped": stopped, "checkpoints": checkpoints, "final": resumed.state.global_step}, handle)
