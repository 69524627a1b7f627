"""Preemption: a signal during training finishes the update, saves a complete checkpoint and ends normally; resuming
from it ends bit-identical to the uninterrupted run; a second signal stops at once."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "preemption_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(model_dir, tmp_path, processes: int, signal_name: str, *extra: str) -> subprocess.CompletedProcess:
    if processes == 1:
        command = [sys.executable, SCRIPT]
        env = ENV
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            "29531", SCRIPT,
        ]  # fmt: skip
        env = {**ENV, "ACCELERATE_USE_CPU": "1"}
    return subprocess.run(
        [*command, model_dir, str(tmp_path), signal_name, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize(("processes", "signal_name"), [(1, "SIGTERM"), (1, "SIGINT"), (2, "SIGUSR1")])
def test_a_signal_saves_a_checkpoint_that_resumes_exactly(tiny_model_dir, tmp_path, processes, signal_name):
    """Signalled during its 3rd update, inside a round of 5 (on rank 0 only, with two processes: the ranks agree to
    stop together), the run stops after that update with checkpoint-3, exits 0, and its resumption ends bit-identical
    to the run that was never signalled (the rest of the round trains on the rollout the checkpoint carries)."""
    completed = _run(tiny_model_dir("flux"), tmp_path, processes, signal_name)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert f"{signal_name} received: finishing the current optimizer update" in completed.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"stopped": 3, "checkpoints": ["checkpoint-3"], "final": 6}
    assert (tmp_path / "preempted" / "checkpoint-3" / "trl_dance_checkpoint.json").exists()  # complete
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys() and all(torch.equal(full[n], resumed[n]) for n in full)


def test_a_second_signal_stops_at_once(tiny_model_dir, tmp_path):
    completed = _run(tiny_model_dir("flux"), tmp_path, 1, "SIGTERM", "twice")
    assert completed.returncode == -signal.SIGTERM, completed.stderr[-2000:]
    assert "SIGTERM again: stopping at once" in completed.stderr
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path / "twice"))


def test_an_update_longer_than_the_grace_exits_without_a_checkpoint(tiny_model_dir, tmp_path):
    """preemption_grace_s=1 and an update that takes 30 s after the signal: the process exits 1 s after the signal
    with status 128 + SIGTERM, saying so, and leaves no checkpoint (the previous complete one, if any, is the state)."""
    import time

    start = time.perf_counter()
    completed = _run(tiny_model_dir("flux"), tmp_path, 1, "SIGTERM", "grace")
    assert completed.returncode == 128 + signal.SIGTERM, completed.stderr[-2000:]
    assert time.perf_counter() - start < 60  # not the 30 s update (plus two rounds and the start)
    assert "did not stop within preemption_grace_s=1.0 s; exiting without a checkpoint" in completed.stderr
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path / "slow"))


def test_a_dead_process_ends_the_run_naming_it(tiny_model_dir, tmp_path):
    """kill -9 of one of two processes mid-training: the other does not wait for a collective timeout (its next
    collective fails, the launcher stops it) and the launcher exits non-zero naming the lost rank and its signal.
    Measured: the launcher ended 1.1 s after the kill (a tiny GRPO run, gloo on this CPU)."""
    import time

    start = time.perf_counter()
    completed = _run(tiny_model_dir("flux"), tmp_path, 2, "SIGKILL")
    assert completed.returncode != 0 and time.perf_counter() - start < 120
    failure = completed.stderr[completed.stderr.index("ChildFailedError") :]
    assert "rank      : 1 (local_rank: 1)" in failure and "(SIGKILL)" in failure


def test_a_save_that_fails_on_one_process_stops_them_all_naming_it(tiny_model_dir, tmp_path):
    """Rank 0's share of a checkpoint fails (a full disk) while rank 1's succeeds: rank 0 raises the named full-disk
    error, rank 1 raises one naming rank 0 and its message instead of waiting at the save's barrier until ddp_timeout,
    and the launcher exits non-zero."""
    import time

    start = time.perf_counter()
    completed = _run(tiny_model_dir("flux"), tmp_path, 2, "SAVEFAIL")
    assert completed.returncode != 0 and time.perf_counter() - start < 120, completed.stderr[-3000:]
    assert "No space left on device" in completed.stderr
    assert "failed on rank 0 of 2, so this process (rank 1) stops too: OSError" in completed.stderr


def test_unknown_preemption_signals_are_refused(tmp_path):
    from trl_dance import DanceGRPOConfig

    with pytest.raises(ValueError, match=r"preemption_signals: \['SIGNOPE'\] are not signals"):
        DanceGRPOConfig(output_dir=str(tmp_path), use_cpu=True, preemption_signals=["SIGTERM", "SIGNOPE"])
    with pytest.raises(ValueError, match="preemption_grace_s must be > 0"):
        DanceGRPOConfig(output_dir=str(tmp_path), use_cpu=True, preemption_grace_s=0)
    with pytest.raises(ValueError, match="hang_report_s must be > 0"):
        DanceGRPOConfig(output_dir=str(tmp_path), use_cpu=True, hang_report_s=-1)


def test_a_process_stuck_in_a_phase_names_its_rank_the_phase_and_where_it_is(tiny_model_dir, tmp_path, caplog):
    """A reward that blocks for 1.5 s against hang_report_s 0.4: the process logs its rank, the phase (reward) and
    its threads' innermost frames (the reward blocking in its worker thread) while it waits, after 0.4, 0.8 and
    1.2 s; the watcher thread ends with training."""
    import time

    from conftest import PROMPTS, tiny_grpo_config
    from datasets import Dataset

    from trl_dance import DanceGRPOTrainer
    from trl_dance.rewards import brightness

    calls = []

    def stalled_reward(prompts, images, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 1:
            time.sleep(1.5)
        return brightness(prompts, images)

    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        stalled_reward,
        args=tiny_grpo_config(tmp_path, max_steps=1, hang_report_s=0.4),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    with caplog.at_level("WARNING", logger="trl_dance.trainer.hang_report"):
        trainer.train()
    messages = [record.getMessage() for record in caplog.records]
    reports = [message for message in messages if "no progress for" in message and "in phase 'reward'" in message]
    assert len(reports) >= 2, messages  # (3 where the watcher is scheduled on time; a loaded machine may merge them)
    assert all("rank 0 of 1" in report and "after step 0 (hang_report_s 0.4)" in report for report in reports)
    assert all("stalled_reward" in report and "time.sleep" in report for report in reports)
    assert not any(thread.name == "trl-dance-hang-report" for thread in threading.enumerate())


def test_a_full_disk_names_the_checkpoint_and_the_space_and_keeps_the_last_one(tiny_model_dir, tmp_path, monkeypatch):
    """torch.save on a full disk raises "basic_ios::clear: iostream error": the trainer says which checkpoint, how
    much space is free and what the last complete checkpoint takes; that checkpoint still resumes."""
    from conftest import PROMPTS, tiny_grpo_config
    from datasets import Dataset

    from trl_dance import DanceGRPOTrainer

    def trainer(max_steps):
        args = tiny_grpo_config(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=1)
        return DanceGRPOTrainer(
            tiny_model_dir("flux"), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
        )

    first = trainer(2)
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path) or "final" in str(path):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0: basic_ios::clear: iostream error"
            )
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        OSError,
        match=r"writing checkpoint '.*checkpoint-2' failed .*iostream error.* GB free there, "
        r"and the latest complete checkpoint \(.*checkpoint-1\) takes .* GB",
    ):
        first.train()
    with pytest.raises(OSError, match=r"writing checkpoint '.*final' failed .*iostream error.* GB free there"):
        first.save_model(str(tmp_path / "final"))  # save_model too (the end of a run: its LoRA and card)
    monkeypatch.setattr(torch, "save", real_save)
    again = trainer(2)
    again.train(resume_from_checkpoint=True)  # checkpoint-2 has no manifest: skipped for checkpoint-1
    assert again.state.global_step == 2


@pytest.mark.parametrize("phase", ["rollout", "reward", "training"])
def test_out_of_memory_names_the_phase_the_sizes_and_the_fields(tiny_model_dir, tmp_path, phase):
    """An out-of-memory error (simulated: this machine has no accelerator to exhaust) comes out naming its phase,
    the config's sizes and the fields that lower that phase's memory, the accelerator's message after them."""
    from conftest import PROMPTS, tiny_grpo_config
    from datasets import Dataset

    from trl_dance import DanceGRPOTrainer

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    reward = out_of_memory if phase == "reward" else "brightness"
    args = tiny_grpo_config(tmp_path, max_steps=1)
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"), reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
    )
    if phase == "rollout":
        trainer.policy.predict = out_of_memory
    elif phase == "training":
        trainer.compute_loss = out_of_memory
    fields = {
        "rollout": "rollout_batch_size",
        "reward": "the reward's batch size",
        "training": "per_device_train_batch_size",
    }
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith(f"out of accelerator memory in the {phase} (32×32, 8 samples per process per round")
    assert f"To lower it: {fields[phase]}" in message and "Tried to allocate 20.00 GiB" in message


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_trl_dance_waits_for_the_checkpoint_and_says_how_to_resume(tiny_model_dir, tmp_path, signal_name):
    """The signal sent to `trl-dance` alone (accelerate's launcher would SIGKILL the script 5 s after SIGTERM and exit
    143, and die of SIGUSR1): the script saves its checkpoint, the command exits 0 and prints the command that
    resumes; no final-looking LoRA at the run's root; the checkpoint's card says the run is unfinished."""

    out = tmp_path / "out"
    recipe = os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml")
    command = [sys.executable, "-m", "trl_dance.cli", "grpo", "--config", recipe, "--model_name_or_path",
               tiny_model_dir("flux"), "--output_dir", str(out), "--max_steps", "200", "--disable_tqdm", "true"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, trained = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if "'loss'" in line:
                trained.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert trained.wait(300), "".join(lines)[-3000:]
    process.send_signal(getattr(signal, signal_name))
    assert process.wait(timeout=300) == 0, "".join(lines)[-3000:]
    reader.join(timeout=30)
    output = "".join(lines)
    assert f"stopped by {signal_name} at step " in output and "--resume_from_checkpoint true" in output
    assert "resume with:\n  trl-dance grpo --config " in output
    (checkpoint,) = [name for name in os.listdir(out) if name.startswith("checkpoint-")]
    assert os.path.isfile(out / checkpoint / "trl_dance_checkpoint.json")
    assert not os.path.exists(out / "pytorch_lora_weights.safetensors")
    with open(out / checkpoint / "README.md") as handle:
        assert "of 200: unfinished" in handle.read()


@pytest.mark.parametrize("where", ["reward", "optimizer step"])
def test_a_crash_writes_a_checkpoint_where_the_state_is_whole(tiny_model_dir, tmp_path, caplog, where):
    """A reward that raises in the 3rd round (one update a round) leaves checkpoint-2, the state after update 2, and
    the error propagates; the resumed run ends bit-identical to an uninterrupted one (this crash came before
    anything of the round was trained). An error inside the 3rd optimizer step leaves no checkpoint: the state there
    is not whole."""
    from conftest import PROMPTS, tiny_grpo_config
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_dance import DanceGRPOTrainer
    from trl_dance.rewards import brightness

    failing = {"on": False}

    def reward(prompts, images, **kwargs):
        if failing["on"]:
            raise ConnectionError("reward server down")
        return brightness(prompts, images)

    class FailAtUpdate3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            failing["on"] = state.global_step == 2

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            def fail(*_):
                if failing["on"]:
                    raise RuntimeError("optimizer blew up")

            optimizer.optimizer.register_step_pre_hook(fail)

    def trainer(output_dir, crash: bool):
        run = DanceGRPOTrainer(
            tiny_model_dir("flux"),
            reward if where == "reward" else "brightness",
            args=tiny_grpo_config(output_dir, max_steps=4, learning_rate=1e-2),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
        if crash:
            run.add_callback(FailAtUpdate3())
        return run

    full = trainer(tmp_path / "full", crash=False)
    full.train()
    with pytest.raises(Exception, match="reward server down" if where == "reward" else "optimizer blew up"):
        trainer(tmp_path / "crashed", crash=True).train()
    assert not any(thread.name == "trl-dance-hang-report" for thread in threading.enumerate())  # (stopped with it)
    checkpoints = sorted(p.name for p in (tmp_path / "crashed").glob("checkpoint-*"))
    if where == "optimizer step":
        assert checkpoints == []
        assert "no checkpoint written: it came inside optimizer update 3, where the state is not whole" in caplog.text
        return
    assert checkpoints == ["checkpoint-2"] and (tmp_path / "crashed" / "checkpoint-2" / "trl_dance_checkpoint.json")
    assert "checkpoint-2 holds the state after update 2: resume with --resume_from_checkpoint true" in caplog.text
    failing["on"] = False
    resumed = trainer(tmp_path / "crashed", crash=False)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
