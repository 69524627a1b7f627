"""Rollout workers (`trl-dance serve-rollouts`, `rollout_server_urls`): a worker's rollouts are the in-process ones,
and a worker that samples with other weights than the version it is given is caught before anything trains on it."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer
from trl_dance.rollout_service import RolloutWorker, identity_differences
from trl_dance.scripts.serve_rollouts import build_app
from trl_dance.testing import load_tiny_pipeline
from trl_dance.trainer.rollout_workers import RolloutWorkerError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(model_dir, output_dir, urls=None, resume=None, **overrides) -> DanceGRPOTrainer:
    values = {"optim": "sgd", "learning_rate": 30.0, "max_steps": 3, "seed": 3, "rollout_server_urls": urls}
    args = tiny_grpo_config(output_dir, **(values | overrides))
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    trainer = DanceGRPOTrainer(
        model_dir, "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def _lora(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _cli_worker(model_dir: str):
    """``trl-dance serve-rollouts --model DIR`` as a process on loopback (one thread, as the tests' trainers)."""
    port = _free_port()
    command = [sys.executable, "-m", "trl_dance.cli", "serve-rollouts", "--model", model_dir, "--port", str(port)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    try:
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the worker did not start: {process.communicate()[1][-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def _thread_worker(model_dir: str, **loading):
    """A worker served from a thread of this process: (worker, url), for the tests that tamper with it."""
    import uvicorn

    worker = RolloutWorker(load_tiny_pipeline(model_dir, **loading), "cpu")
    port = _free_port()
    config = uvicorn.Config(build_app(worker), host="127.0.0.1", port=port, log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield worker, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def cli_worker(tiny_model_dir):
    """One `trl-dance serve-rollouts` process for the module's runs (each trainer's handshake starts it afresh)."""
    with _cli_worker(tiny_model_dir("flux")) as url:
        yield url


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_worker_run_equals_the_in_process_run(tiny_model_dir, tmp_path, cli_worker, staleness):
    """3 rounds of GRPO with a LoRA sampled by a `trl-dance serve-rollouts` process end with the in-process run's
    LoRA and rewards, bit for bit (at max_staleness 1 too: the versions bound to the rounds are the same)."""
    model_dir = tiny_model_dir("flux")
    local = _train(model_dir, tmp_path / "local", max_staleness=staleness)
    served = httpx.get(f"{cli_worker}/health").json()["served"]
    remote = _train(model_dir, tmp_path / "remote", [cli_worker], max_staleness=staleness)
    assert httpx.get(f"{cli_worker}/health").json()["served"] == served + 3  # one chunk a round
    a, b = _lora(local), _lora(remote)
    assert max((a[n] - b[n]).abs().max().item() for n in a) == 0.0
    rewards = [[e["reward"] for e in t.state.log_history if "reward" in e] for t in (local, remote)]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3


def test_a_stale_adapter_is_refused_naming_version_and_hash(tiny_model_dir, tmp_path):
    """A worker that samples a round with an older version than the one it was sent (and hashes what it used)."""
    model_dir = tiny_model_dir("flux")
    with _thread_worker(model_dir) as (worker, url):
        honest_bind, honest_rollout, serving = worker._bind, worker.rollout, [False]

        def rollout(tensors, request):
            serving[0] = True
            try:
                return honest_rollout(tensors, request)
            finally:
                serving[0] = False

        worker._bind = lambda version: honest_bind(min(worker.versions) if serving[0] else version)
        worker.rollout = rollout
        with pytest.raises(RolloutWorkerError, match=r"sampled with version 1 .*bound to version 1, published as"):
            _train(model_dir, tmp_path, [url], max_steps=2)


def test_an_unbound_adapter_is_caught_by_the_audit(tiny_model_dir, tmp_path):
    """A worker whose LoRA holds the published tensors (so their hash matches) but does not act on its outputs (its
    layers scaled by 0, as an adapter bound to nothing)."""
    from peft.tuners.lora import LoraLayer

    model_dir = tiny_model_dir("flux")
    with _thread_worker(model_dir) as (worker, url):
        honest_bind = worker._bind

        def unbound(version):
            digest = honest_bind(version)
            for module in worker.policy.denoiser.modules():
                if isinstance(module, LoraLayer):
                    module.scaling["default"] = 0.0
            return digest

        worker._bind = unbound
        # (Round 0 passes: the LoRA starts with B = 0, acting on nothing either way.)
        with pytest.raises(
            RolloutWorkerError, match=r"audit of rollout worker .* round 1, version 1 \(live LoRA SHA"
        ) as error:
            _train(model_dir, tmp_path, [url], max_steps=2)
        assert float(str(error.value).split("next state is ")[1].split(" stds")[0]) > 10 * 1e-3  # (0.043 measured)


def test_a_worker_with_other_base_weights_is_refused_at_the_handshake(tiny_model_dir, tmp_path):
    """Other weights: the digests differ; another dtype is named as such before the digest."""
    model_dir = tiny_model_dir("flux")
    with _thread_worker(model_dir) as (worker, url):
        with torch.no_grad():
            next(worker.pipeline.transformer.parameters()).add_(1e-3)
        with pytest.raises(RolloutWorkerError, match=r"refused the handshake: .*fingerprint: worker '\w{12}…'"):
            _train(model_dir, tmp_path, [url], max_steps=1)
        worker.pipeline.transformer.to(torch.bfloat16)
        with pytest.raises(RolloutWorkerError, match=r"dtypes: worker \['bfloat16'\], trainer \['float32'\]; "):
            _train(model_dir, tmp_path, [url], max_steps=1)


def test_identity_differences_name_each_entry():
    mine = {"policy": "FluxPolicy", "software": {"torch": "2.13", "diffusers": "0.37"}, "fingerprint": "a" * 64}
    theirs = {"policy": "FluxPolicy", "software": {"torch": "2.14", "diffusers": "0.37"}, "fingerprint": "b" * 64}
    assert identity_differences(mine, theirs) == [
        "software.torch: worker '2.13', trainer '2.14'",
        f"fingerprint: worker '{'a' * 12}…', trainer '{'b' * 12}…'",
    ]


def test_workers_that_cannot_serve_are_named_when_the_trainer_is_built(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Probed at construction (no round runs): nothing listening is refused after the grace of refused connections
    (not the whole server timeout), a worker still loading is waited for with a line saying so, one whose model failed
    names the failure; each a ValueError (the CLI prints one line)."""
    from trl_dance.trainer import rollout_workers

    model_dir = tiny_model_dir("flux")
    monkeypatch.setattr(rollout_workers, "REFUSED_GRACE", 0.5)
    monkeypatch.setattr(DanceGRPOTrainer, "train", lambda self, **kwargs: pytest.fail("the probe ran in training"))
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(
        RolloutWorkerError, match=f"rollout worker {url} refused the connection .*nothing listens"
    ) as e:
        _train(model_dir, tmp_path, [url])  # the default rollout_server_timeout, 240 s: not waited for
    assert isinstance(e.value, ValueError)
    with _thread_worker(model_dir) as (worker, url):
        worker.pipeline, worker.loading = None, "some/model"
        with pytest.raises(RolloutWorkerError, match=r"not ready within rollout_server_timeout \(1 s\): loading"):
            _train(model_dir, tmp_path, [url], rollout_server_timeout=1.0)
        assert f"waiting for rollout worker {url} (loading some/model; up to 1 s)" in capsys.readouterr().out
        with pytest.raises(OSError, match="no such folder"):
            worker.load(lambda: (_ for _ in ()).throw(OSError("no such folder")), "some/model")
        with pytest.raises(RolloutWorkerError, match="failed to load its model: OSError: no such folder"):
            _train(model_dir, tmp_path, [url])


def test_resume_with_a_worker_and_rounds_in_flight_is_exact(tiny_model_dir, tmp_path):
    """max_staleness 1 with a worker, 3 rounds of 5 updates, resumed at the first round boundary (the next round in
    flight, audited before it was saved): the LoRA of the uninterrupted run, bit for bit."""
    model_dir = tiny_model_dir("flux")
    common = {"max_staleness": 1, "gradient_accumulation_steps": 1, "max_steps": 15, "save_strategy": "steps"}
    with _thread_worker(model_dir) as (_, url):
        whole = _train(model_dir, tmp_path, [url], save_steps=5, **common)
        resumed = _train(model_dir, tmp_path, [url], save_steps=5, resume=tmp_path / "checkpoint-5", **common)
    a, b = _lora(whole), _lora(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_rollout_workers_refuse_what_they_cannot_serve(tiny_model_dir, tmp_path):
    from trl_dance import DirectRewardConfig, DirectRewardTrainer

    url = "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="rollout_backprop is exact only .*rollout_server_urls"):
        tiny_grpo_config(tmp_path, rollout_server_urls=[url], rollout_backprop=True)
    with pytest.raises(ValueError, match="the workers' chunks are scored as they arrive"):
        tiny_grpo_config(tmp_path, rollout_server_urls=[url], reward_worker_thread=False)
    model_dir, dataset = tiny_model_dir("flux"), Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match="rollout_server_urls: rollout workers receive a LoRA"):
        DanceGRPOTrainer(model_dir, "brightness", args=tiny_grpo_config(tmp_path, rollout_server_urls=[url]),
                         train_dataset=dataset)  # fmt: skip
    values = {
        k: v for k, v in tiny_grpo_config(tmp_path).to_dict().items() if k in DirectRewardConfig.__dataclass_fields__
    }
    values = {k: v for k, v in values.items() if k in ("output_dir", "use_cpu", "report_to", "num_generations",
              "generation_batch_size", "num_inference_steps", "height", "width", "max_sequence_length")}  # fmt: skip
    with pytest.raises(ValueError, match="rollout_server_urls: DirectRewardTrainer back-propagates"):
        DirectRewardTrainer(model_dir, "brightness", args=DirectRewardConfig(**values, rollout_server_urls=[url]),
                            train_dataset=dataset, peft_config=LoraConfig(r=4, target_modules=["to_q"]))  # fmt: skip


def test_a_worker_on_a_bf16_base_takes_the_float32_lora(tiny_model_dir, tmp_path):
    """The configuration users run: the base loaded in bf16 on both sides, the LoRA trained in float32. The worker keeps
    its LoRA in float32 too, so the published versions bind (a bf16 LoRA would refuse them) and the round is audited."""
    model_dir = tiny_model_dir("flux")
    with _thread_worker(model_dir, dtype=torch.bfloat16) as (worker, url):
        trainer = _train(model_dir, tmp_path, [url], max_steps=2, model_init_kwargs={"dtype": "bfloat16"})
        assert worker.served == 2 and next(worker.policy.denoiser.parameters()).dtype == torch.bfloat16
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
