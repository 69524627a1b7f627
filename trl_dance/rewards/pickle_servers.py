"""Clients of the reward servers ddpo-pytorch and Flow-GRPO users already run, which speak pickle over HTTP.

**Trusted networks only**: the server's answer is unpickled, and unpickling runs whatever code the answer names;
point these at servers you run yourself. New servers should speak the JSON protocol of
:mod:`trl_dance.rewards.remote` (``trl-dance serve-reward``).

* :class:`LLaVABertScore`: ddpo-pytorch's prompt–image alignment (kvablack/LLaVA-server): LLaVA describes the image,
  BERTScore's recall against "The image contains <prompt>" is the reward.
* :class:`DeQAReward`: Flow-GRPO's DeQA image-quality server.
* :class:`GenEvalReward`: Flow-GRPO's GenEval server (object counts, colours, positions), with the prompt's GenEval
  metadata in a dataset column.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from PIL import Image

from .image_transforms import to_uint8
from .remote import HTTPReward, RemoteRewardError


def jpeg_bytes(images: torch.Tensor, quality: int | None) -> list[bytes]:
    """(B, 3, H, W) in [0, 1] → 8-bit JPEG files (``quality`` None: PIL's default, 75)."""
    files = []
    for array in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", **({"quality": quality} if quality is not None else {}))
        files.append(buffer.getvalue())
    return files


class PickleServerReward(HTTPReward):
    """A reward whose server takes a pickled dict of JPEG images (and more) and answers a pickled dict.

    Args:
        url: the server's address (it answers ``POST`` at that path).
        batch_size: images per request (the reference clients': 16 LLaVA, 64 DeQA/GenEval).
        jpeg_quality: the reference clients' JPEG quality.
        max_concurrency, timeout, max_retries, backoff: as :class:`~trl_dance.rewards.remote.RemoteReward`'s.
        trust_remote_pickle: must be True: the server's answer is unpickled, which runs whatever code the answer
            names, so only a server you run, on a network you trust, may be called.
    """

    name = "pickle_server"
    default_url = "http://127.0.0.1:8085"
    default_batch_size = 16
    jpeg_quality: int | None = None

    def __init__(
        self,
        url: str | None = None,
        batch_size: int | None = None,
        max_concurrency: int = 1,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        name: str | None = None,
        trust_remote_pickle: bool = False,
    ):
        if trust_remote_pickle is not True:
            raise ValueError(
                f"{name or self.name}: this client unpickles the server's answer, and unpickling runs whatever code "
                "the answer names; pass trust_remote_pickle=True only for a server you run on a network you trust "
                "(or serve the reward with `trl-dance serve-reward`, which speaks JSON)"
            )
        self._init_http(max_concurrency, timeout, max_retries, backoff, None)
        self.url = url or self.default_url
        self.batch_size = batch_size or self.default_batch_size
        self.__name__ = name or self.name

    def request(self, images: torch.Tensor, prompts: list[str], columns: dict[str, list]) -> dict[str, Any]:
        """The dict to pickle for one batch."""
        raise NotImplementedError

    def rewards(self, answer: dict[str, Any], size: int, log_metric) -> list[float]:
        """The batch's rewards from the server's unpickled answer."""
        raise NotImplementedError

    def __call__(
        self, prompts: list[str], images: torch.Tensor, log_metric=None, completions=None, **columns
    ) -> list[float]:
        columns.pop("trainer_state", None)
        starts = list(range(0, len(prompts), self.batch_size))

        def score(index: int, start: int) -> list[float]:
            end = min(start + self.batch_size, len(prompts))
            where = f"{self.__name__} server {self.url}, batch {index} (samples {start}–{end - 1})"
            batch = {key: values[start:end] for key, values in columns.items()}
            payload = pickle.dumps(self.request(images[start:end], list(prompts[start:end]), batch))
            response = self._post(self.url, payload, where)
            try:
                answer = pickle.loads(response.content)  # trusted servers only (see the module docstring)
                values = [float(v) for v in self.rewards(answer, end - start, log_metric)]
            except Exception as err:
                raise RemoteRewardError(f"{where}: unexpected answer ({type(err).__name__}: {err})") from err
            if len(values) != end - start:
                raise RemoteRewardError(f"{where}: {len(values)} rewards for {end - start} samples")
            return values

        return [value for batch in self._map(score, list(range(len(starts))), starts) for value in batch]


def _flat(values) -> list[float]:
    """A server's per-sample values, given as scalars or one-element lists."""
    return [float(torch.as_tensor(value, dtype=torch.float64).flatten()[0]) for value in values]


class LLaVABertScore(PickleServerReward):
    """ddpo-pytorch's ``llava_bertscore``: LLaVA answers ``question`` about each image, and the reward is the
    BERTScore recall of its answer against ``answer_template.format(prompt=...)`` (precision and F1 go to
    ``log_metric``)."""

    name = "llava_bertscore"
    jpeg_quality = 80

    def __init__(
        self,
        url: str | None = None,
        question: str = "Answer concisely: what is going on in this image?",
        answer_template: str = "The image contains {prompt}",
        **kwargs,
    ):
        super().__init__(url, **kwargs)
        self.question, self.answer_template = question, answer_template

    def request(self, images, prompts, columns):
        return {
            "images": jpeg_bytes(images, self.jpeg_quality),
            "queries": [[self.question]] * len(prompts),
            "answers": [[self.answer_template.format(prompt=prompt)] for prompt in prompts],
        }

    def rewards(self, answer, size, log_metric):
        if log_metric is not None:
            for key in ("precision", "f1"):
                values = _flat(answer[key])
                log_metric(f"{self.__name__}/{key}", sum(values) / len(values))
        return _flat(answer["recall"])


class DeQAReward(PickleServerReward):
    """Flow-GRPO's DeQA image-quality score (its server's ``outputs``); the prompt is not used."""

    name = "deqa"
    default_url = "http://127.0.0.1:18086"
    default_batch_size = 64

    def request(self, images, prompts, columns):
        return {"images": jpeg_bytes(images, self.jpeg_quality)}

    def rewards(self, answer, size, log_metric):
        return _flat(answer["outputs"])


class GenEvalReward(PickleServerReward):
    """Flow-GRPO's GenEval reward: the server checks each image against its prompt's GenEval metadata (the dataset
    column ``metadata_column``: objects, counts, colours, positions) and answers per-image ``scores`` (the training
    reward, ``field``), ``rewards`` and ``strict_rewards`` (their means go to ``log_metric``)."""

    name = "geneval"
    default_url = "http://127.0.0.1:18085"
    default_batch_size = 64

    def __init__(self, url: str | None = None, metadata_column: str = "metadata", field: str = "scores",
                 only_strict: bool = True, **kwargs):  # fmt: skip
        super().__init__(url, **kwargs)
        self.metadata_column, self.field, self.only_strict = metadata_column, field, only_strict

    def request(self, images, prompts, columns):
        if self.metadata_column not in columns:
            raise ValueError(
                f"{self.__name__} needs each prompt's GenEval metadata in the dataset column {self.metadata_column!r}"
            )
        return {
            "images": jpeg_bytes(images, self.jpeg_quality),
            "meta_datas": list(columns[self.metadata_column]),
            "only_strict": self.only_strict,
        }

    def rewards(self, answer, size, log_metric):
        if log_metric is not None:
            for key in ("rewards", "strict_rewards"):
                if answer.get(key):
                    values = _flat(answer[key])
                    log_metric(f"{self.__name__}/{key}", sum(values) / len(values))
        return _flat(answer[self.field])
