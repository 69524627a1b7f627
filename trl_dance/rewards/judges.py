"""VLM judges over OpenAI-compatible chat completions (vLLM, sglang, TGI, or a hosted API serving e.g.
UnifiedReward, Qwen2.5-VL): a pointwise score parsed from the answer, or pairwise preferences within a group.

Each request is ``POST {base_url}/chat/completions`` with the images as ``data:image/png;base64`` URLs; requests run
``max_concurrency`` at a time (in the trainer's reward thread, so they overlap the next chunk's denoising), with the
timeouts, retries and errors of :func:`~trl_dance.rewards.remote.post_with_retries`.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import torch

from .remote import HTTPReward, RemoteRewardError, encode_image

POINTWISE_TEMPLATE = (
    "You are given a text caption and an image generated from it. Judge how well the image matches the caption and "
    "how good it looks. Caption: {prompt}\nReason briefly, then end with 'Final Score: X', X from 1 to 5."
)
PAIRWISE_TEMPLATE = (
    "You are given a text caption and two images generated from it. Which image matches the caption better and looks "
    "better? Caption: {prompt}\nReason briefly, then end with 'Final Answer: Image 1' or 'Final Answer: Image 2'."
)


class ChatJudge(HTTPReward):
    """The chat-completions client the judges share.

    Args:
        base_url: the server's OpenAI-compatible root, e.g. ``http://10.0.0.5:8000/v1``.
        model: the served model's name.
        template: the question, with ``{prompt}``; pattern: a regular expression whose first group is the answer.
        api_key: sent as a bearer token when given.
        temperature, max_tokens: sampling of the answer (0: greedy, reproducible).
        max_concurrency, timeout, max_retries, backoff: as :class:`~trl_dance.rewards.remote.RemoteReward`'s.
    """

    name = "judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        template: str,
        pattern: str,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        max_concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        name: str | None = None,
    ):
        if "{prompt}" not in template:
            raise ValueError("the judge's template must contain '{prompt}'")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._init_http(max_concurrency, timeout, max_retries, backoff, headers)
        self.base_url, self.model = base_url.rstrip("/"), model
        self.template, self.pattern = template, re.compile(pattern, re.IGNORECASE)
        self.temperature, self.max_tokens = temperature, max_tokens
        self.__name__ = name or self.name

    def ask(self, prompt: str, images: list[torch.Tensor]) -> str:
        """The judge's answer to ``template`` about ``prompt`` with ``images`` (3, H, W) in [0, 1]."""
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encode_image(image, 'png')}"}}
            for image in images
        ]
        content.append({"type": "text", "text": self.template.format(prompt=prompt)})
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        where = f"judge {self.base_url} ({self.model}), prompt {prompt!r:.60}"
        response = self._post(f"{self.base_url}/chat/completions", payload, where)
        try:
            return response.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise RemoteRewardError(f"{where}: not a chat completion: {response.text[:300]!r}") from err

    def parse(self, answer: str) -> str | None:
        """The last match of ``pattern``'s first group in ``answer``, or None."""
        matches = self.pattern.findall(answer)
        return matches[-1] if matches else None


class PointwiseJudge(ChatJudge):
    """A score per image parsed from the judge's answer (UnifiedReward's "Final Score: X"). An answer without a
    score abstains on that image (None), counted by ``log_metric("<name>/unparsed", fraction)``."""

    name = "vlm_judge"

    def __init__(self, base_url: str, model: str, template: str = POINTWISE_TEMPLATE,
                 pattern: str = r"Final Score:\s*\**\s*([-+]?\d+(?:\.\d+)?)", **kwargs):  # fmt: skip
        super().__init__(base_url, model, template, pattern, **kwargs)

    def __call__(self, prompts: list[str], images: torch.Tensor, log_metric=None, **_) -> list[float | None]:
        answers = self._map(lambda i: self.parse(self.ask(prompts[i], [images[i]])), list(range(len(prompts))))
        if log_metric is not None:
            log_metric(f"{self.__name__}/unparsed", sum(a is None for a in answers) / max(len(answers), 1))
        return [None if answer is None else float(answer) for answer in answers]


class PairwiseJudge(ChatJudge):
    """Pref-GRPO's pairwise preference reward: each sample's win rate against the other samples of its group.

    Every unordered pair is asked in both orders (image i first, then j first) so that a judge's position bias cancels:
    a judge that always answers "Image 1" gives every sample a win rate of ½. An unparsable answer counts as a tie.
    ``G (G − 1)`` requests per group of G. Declared ``groupwise``: the trainer passes one group per call.
    """

    name = "pairwise_judge"
    groupwise = True

    def __init__(self, base_url: str, model: str, template: str = PAIRWISE_TEMPLATE,
                 pattern: str = r"Final Answer:\s*\**\s*Image\s*([12])", **kwargs):  # fmt: skip
        super().__init__(base_url, model, template, pattern, **kwargs)

    def __call__(self, prompts: list[str], images: torch.Tensor, log_metric=None, **_) -> list[float]:
        size = len(prompts)
        if size < 2:
            return [0.5] * size
        if len(set(prompts)) != 1:
            raise ValueError(f"{self.__name__} compares the samples of one prompt; got {len(set(prompts))} prompts")
        ordered = list(itertools.permutations(range(size), 2))
        answers = self._map(lambda pair: self.parse(self.ask(prompts[0], [images[pair[0]], images[pair[1]]])), ordered)
        wins = [0.0] * size
        for (first, second), answer in zip(ordered, answers):
            if answer == "1":
                wins[first] += 1
            elif answer == "2":
                wins[second] += 1
            else:  # a tie
                wins[first] += 0.5
                wins[second] += 0.5
        if log_metric is not None:
            log_metric(f"{self.__name__}/unparsed", sum(a is None for a in answers) / len(answers))
        return [w / (2 * (size - 1)) for w in wins]
