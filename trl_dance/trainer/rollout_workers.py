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

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..rewards.remote import RemoteRewardError, post_with_retries
from ..rollout_service import pack, tensor_digest, unpack


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


__all__ = ["RolloutWorkerError", "RolloutWorkers", "audit_positions"]
