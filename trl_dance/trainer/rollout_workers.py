"""The trainer's side of rollout workers (``rollout_server_urls``): handshake, versions published and verified, chunks
dispatched with retries, and every answer checked before anything trains on it.

Nothing unverified is trained on: an answer counts only if it names the version its round is bound to and the SHA-256
the worker read back from its live LoRA parameters equals the one the trainer published for that version; on the main
thread, before the round trains, ``rollout_audit_transitions`` of each chunk's stored transitions are recomputed under
that version's weights (a worker that bound the tensors to nothing, or samples with another schedule, guidance or
base, differs there). A worker that cannot be reached after its retries hands its chunks to the next one; none left
is an error naming them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..rewards.remote import RemoteRewardError, post_with_retries
from ..rollout_service import ROLLOUT_TOKEN_ENV, lora_description, pack, sampling_identity, tensor_digest, unpack
from ..sampling import mix_seed, step_noise
from .old_policy import _Proxy


class RolloutWorkerError(RuntimeError):
    """A worker's answer failed verification, or no worker could serve a chunk: training stops."""


class RolloutWorkerSetupError(RolloutWorkerError, ValueError):
    """A worker that cannot serve this run, found at the handshake (not running, still loading past the timeout,
    refusing the trainer's settings): a user error, reported by ``trl-dance`` in one line."""


REFUSED_GRACE = 10.0
"""Seconds of refused connections after which a worker is taken for not running (it listens before loading)."""


class RolloutWorkers:
    """The client of the ``serve-rollouts`` workers at ``urls`` (one process's; each training process talks to them
    for its own chunks).

    Args:
        urls: the workers' base URLs.
        token: their bearer token, if they require one.
        request_timeout: seconds per request (a chunk's rollout included).
        server_timeout: seconds to wait for every worker to answer ``/health`` at the handshake.
        max_retries: retries of one request on one worker (timeouts, connection errors, 5xx) before the next worker.
    """

    def __init__(
        self,
        urls: list[str],
        token: str | None = None,
        request_timeout: float = 600.0,
        server_timeout: float = 240.0,
        max_retries: int = 2,
    ):
        import httpx

        self.urls = [url.rstrip("/") for url in urls]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=request_timeout, headers=headers)
        self.server_timeout, self.max_retries = server_timeout, max_retries
        self.published: dict[int, str] = {}  # version → SHA-256 of the tensors published
        self._pool = ThreadPoolExecutor(max(2, 2 * len(self.urls)), "rollout-client")
        self._next = 0

    def handshake(self, info: dict[str, Any]) -> None:
        """Wait for every worker to be ready, then send ``info``. A worker that refuses connections for
        ``REFUSED_GRACE`` seconds is not running (a worker listens before it loads its model), one still loading is
        waited for up to ``server_timeout`` with a line saying so; these, a worker whose model failed to load and a
        refusal (the worker's base, software or LoRA differs) raise :class:`RolloutWorkerSetupError` naming the
        worker."""
        for url in self.urls:
            self._wait_until_ready(url)
            response = self.client.post(f"{url}/handshake", json=info)
            if response.status_code != 200:
                raise RolloutWorkerSetupError(f"rollout worker {url} refused the handshake: {response.text[:1000]}")

    def _wait_until_ready(self, url: str) -> None:
        import httpx

        start, said = time.monotonic(), False
        while True:
            waited = time.monotonic() - start
            try:
                response = self.client.get(f"{url}/health", timeout=5.0)
                health = response.json() if response.headers.get("content-type") == "application/json" else {}
                if response.status_code == 200 and health.get("status") != "loading":
                    return
                if health.get("status") == "failed":
                    raise RolloutWorkerSetupError(
                        f"rollout worker {url} failed to load its model: {health.get('error')}"
                    )
                why = f"loading {health.get('model', 'its model')}" if health else f"HTTP {response.status_code}"
            except httpx.ConnectError as err:
                if waited > min(REFUSED_GRACE, self.server_timeout):
                    raise RolloutWorkerSetupError(
                        f"rollout worker {url} refused the connection for {waited:.0f} s: nothing listens there "
                        f"({err}); start it (trl-dance serve-rollouts --model ... --port N) or fix rollout_server_urls"
                    ) from None
                why = "connection refused"
            except httpx.HTTPError as err:
                why = f"{type(err).__name__}: {err}"
            if waited > self.server_timeout:
                raise RolloutWorkerSetupError(
                    f"rollout worker {url} was not ready within rollout_server_timeout ({self.server_timeout:g} s): {why}"
                )
            if not said:
                print(f"waiting for rollout worker {url} ({why}; up to {self.server_timeout:g} s)", flush=True)
                said = True
            time.sleep(0.5)

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> str:
        """Send version ``version`` of the rollout weights to every worker; each must answer with the SHA-256 of its
        live parameters equal to the tensors'. Returns that SHA-256."""
        sha256 = tensor_digest(tensors)
        body = pack(tensors, {"version": version})
        for url in self.urls:
            where = f"rollout worker {url}, version {version}"
            answer = self._request(url, f"/weights/{version}", body, where, method="PUT").json()
            if answer.get("sha256") != sha256:
                raise RolloutWorkerError(
                    f"{where}: its live LoRA parameters hash to {answer.get('sha256')}, the published version to "
                    f"{sha256}: the weights did not bind"
                )
        self.published[version] = sha256
        return sha256

    def submit(
        self, tensors: dict[str, torch.Tensor], request: dict[str, Any], then: Callable[[dict, dict], Any]
    ) -> Future:
        """Dispatch one chunk; the future runs ``then(rollout tensors, answer)`` on the verified answer (in a client
        thread) and returns its result."""
        first = self._next % len(self.urls)
        self._next += 1
        body = pack(tensors, request)
        return self._pool.submit(self._serve, body, request, first, then)

    def _serve(self, body: bytes, request: dict[str, Any], first: int, then: Callable[[dict, dict], Any]):
        version, failures = request["version"], []
        for offset in range(len(self.urls)):
            url = self.urls[(first + offset) % len(self.urls)]
            where = f"rollout worker {url}, round {request['round']}, samples from {request['first_index']}"
            try:
                response = self._request(url, "/rollouts", body, where)
            except RemoteRewardError as err:
                failures.append(str(err))
                continue
            rollout, answer = unpack(response.content)
            if answer.get("version") != version or answer.get("sha256") != self.published.get(version):
                raise RolloutWorkerError(
                    f"{where}: sampled with version {answer.get('version')} (live LoRA SHA-256 {answer.get('sha256')}); "
                    f"the round is bound to version {version}, published as {self.published.get(version)}: a stale or "
                    "unbound adapter, nothing of it is trained on"
                )
            return then(rollout, answer | {"worker": url, "chunk_start": request["chunk_start"]})
        raise RolloutWorkerError(f"no rollout worker could serve a chunk: {'; '.join(failures)}")

    def _request(self, url: str, path: str, body: bytes, where: str, method: str = "POST"):
        try:
            return post_with_retries(self.client, url + path, body, self.max_retries, 0.5, where, method)
        except RemoteRewardError as err:
            if (
                err.status is not None and 400 <= err.status < 500
            ):  # a refusal, not an outage: the next worker would refuse it too
                raise RolloutWorkerError(str(err)) from None
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def audit_positions(seed: int, count: int, batch: int, stored: int) -> list[tuple[int, int]]:
    """``count`` seeded (sample, stored transition) pairs of a chunk of ``batch`` samples with ``stored`` transitions
    each (the same on every run of the same chunk)."""
    if stored == 0 or count == 0:
        return []
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randperm(batch * stored, generator=generator)[:count]
    return [(int(p) // stored, int(p) % stored) for p in picks]


class RemoteRollouts:
    """A run's rollouts sampled by its workers, one training process's side: the handshake (at construction, so that
    a dead or mismatched worker is named before the first round), each version of the rollout weights published once
    and kept while a round it sampled may still be consumed, the chunks dispatched, and each answered round audited.

    Args:
        policy: the trained policy (its settings, LoRA and sampling identity are what the workers must match).
        args: the run's config (``rollout_server_*``, ``rollout_audit_*``, ``seed``, ``num_generations``,
            ``max_staleness``, ``mixed_precision``).
        device: where the answered tensors go.
        autocast: the trainer's compute context (its mixed precision), around the audit's forwards.
    """

    def __init__(self, policy, args, device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager]):
        self.policy, self.args, self.device, self.autocast = policy, args, device, autocast
        token = args.rollout_server_token or os.environ.get(ROLLOUT_TOKEN_ENV) or None
        self.workers = RolloutWorkers(
            args.rollout_server_urls, token, args.rollout_request_timeout, args.rollout_server_timeout
        )
        self.workers.handshake(
            {
                "settings": dataclasses.asdict(policy.settings),
                "condition_columns": list(policy.condition_columns),  # (optional ones change the policy's layout)
                "lora": lora_description(policy.denoiser.peft_config["default"]),
                "mixed_precision": args.mixed_precision,
                **sampling_identity(policy),
            }
        )
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # published rollout weights, for the audits

    @property
    def urls(self) -> list[str]:
        return self.workers.urls

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Send ``weights`` (the trained tensors rollouts sample with, by parameter name) as ``version`` to the
        workers, once, and keep a copy for the audits of the rounds it samples."""
        if version in self.workers.published:
            return
        tensors = {name: value.detach().clone() for name, value in weights.items()}
        self.workers.publish(version, tensors)
        self.versions[version] = tensors
        for old in [v for v in self.versions if v < version - self.args.max_staleness - 1]:
            del self.versions[old]

    def submit(
        self,
        request: dict[str, Any],
        cond: dict[str, torch.Tensor],
        initial_noise: torch.Tensor,
        generators: list[torch.Generator],
        score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    ) -> Future:
        """Dispatch one chunk (``request``: its version, round, indices and plan); the future gives the verified
        chunk's tensors on the device, its answer (with the chunk's generator states, for the audit) and
        ``score(tensors)``, all in a client thread."""
        states = torch.stack([g.get_state() for g in generators])
        tensors = {f"cond.{key}": value for key, value in cond.items()}
        tensors |= {"initial_noise": initial_noise, "generator_states": states}

        def verified(rollout: dict, answer: dict) -> tuple[dict, dict, torch.Tensor]:
            rollout = {key: value.to(self.device) for key, value in rollout.items()}
            return rollout, answer | {"generator_states": states}, score(rollout)

        return self.workers.submit(tensors, request, verified)

    @torch.no_grad()
    def audit(self, record, prompt_index: torch.Tensor, first_index: int) -> None:
        """Recompute ``rollout_audit_transitions`` stored transitions of each worker chunk of ``record`` (a
        :class:`~trl_dance.trainer.async_rounds.RoundRecord`; ``prompt_index`` (B,) its rows' prompts, its first
        sample at global index ``first_index``) under its version's weights: with the step's noise drawn again from
        the chunk's generator states, the stored next state must be the recomputed step's mean plus its std times
        that noise; an element off by more than ``rollout_audit_tolerance`` stds stops training."""
        args, rollout, policy = self.args, record.rollout, self.policy
        if record.audited or not record.answers:
            return
        record.audited = True
        log_probs = rollout.get("log_probs")
        if not args.rollout_audit_transitions or log_probs is None or log_probs.shape[1] == 0:
            return  # (deterministic rollouts store no transition: the hash check stands alone)
        tolerance = args.rollout_audit_tolerance
        if tolerance is None:
            tolerance = 1e-3 if args.mixed_precision == "no" else 0.1
        model = _Proxy(policy.denoiser, self.versions[record.version])
        latents, batch = rollout["latents"], log_probs.shape[0]
        starts = record.plan.starts(batch)
        for answer in record.answers:
            start, count = answer["chunk_start"], answer["count"]
            seed = mix_seed(args.seed, record.round, first_index + start, 0xA0D17)
            for sample, stored in audit_positions(seed, args.rollout_audit_transitions, count, log_probs.shape[1]):
                row, i = start + sample, int(starts[start + sample]) + stored
                generator = torch.Generator()
                generator.set_state(answer["generator_states"][sample].clone())
                group = (first_index + row) // args.num_generations
                noise = step_noise(record.plan, [generator], latents.shape[2:], [group])[i, 0]
                x, step = latents[row : row + 1, stored], torch.tensor([i], device=self.device)
                cond = {key: value[prompt_index[row : row + 1]] for key, value in record.cond.items()}
                with self.autocast():
                    output = policy.predict(model, x, cond, at=step)
                    again = policy.step(output, x, step, prev_sample=latents[row : row + 1, stored + 1])
                implied = (latents[row, stored + 1].float() - again.mean[0].float()) / again.std
                off = (implied - noise.to(self.device)).abs().max().item()
                if not off <= tolerance:
                    raise RolloutWorkerError(
                        f"audit of rollout worker {answer['worker']}, round {record.round}, version {record.version} "
                        f"(live LoRA SHA-256 {answer['sha256']}): sample {first_index + row}, step {i}: its next state "
                        f"is {off:.3g} stds from the step recomputed under the version with its own noise "
                        f"(rollout_audit_tolerance {tolerance:g}); the worker does not sample with the weights it "
                        "hashed (an adapter bound to nothing, another base, schedule or guidance)"
                    )


__all__ = ["RemoteRollouts", "RolloutWorkerError", "RolloutWorkers", "audit_positions"]
