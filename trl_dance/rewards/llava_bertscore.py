"""ddpo-pytorch's prompt–image alignment as a local model reward: a LLaVA answers a question about each image, and the
reward is the BERTScore recall of the expected answer ("The image contains {prompt}") against LLaVA's answer.

The same computation as the LLaVA server behind :class:`~trl_dance.rewards.pickle_servers.LLaVABertScore`, in
process: transformers' ``LlavaForConditionalGeneration`` (llava-hf checkpoints), greedy decoding, the answer's first
sentence, and BERTScore with ``microsoft/deberta-xlarge-mnli`` at layer 40 (bert-score's default for that model, no
idf weighting, no baseline rescaling).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image

from .image_transforms import check_images, to_uint8
from .model_reward import RewardModel, from_pretrained


def bertscore(
    candidates: torch.Tensor,
    candidate_weights: torch.Tensor,
    references: torch.Tensor,
    reference_weights: torch.Tensor,
    candidate_mask: torch.Tensor,
    reference_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERTScore (Zhang et al. 2020) precision, recall and F1, each (B,), of candidate vs reference token embeddings.

    Recall averages, over the reference tokens (weighted by ``reference_weights``: 0 for [CLS]/[SEP] and padding),
    each token's highest cosine similarity to a candidate token (any token of the candidate but padding:
    ``candidate_mask``); precision is the same with the roles swapped.

    Args:
        candidates: (B, Lc, D) token embeddings; references: (B, Lr, D).
        candidate_weights, reference_weights: (B, Lc), (B, Lr) non-negative, each row with a positive sum.
        candidate_mask, reference_mask: (B, Lc), (B, Lr) bool, True on real (non-padding) tokens.
    """
    similarity = F.normalize(candidates, dim=-1) @ F.normalize(references, dim=-1).transpose(1, 2)  # (B, Lc, Lr)
    low = torch.finfo(similarity.dtype).min
    best_reference = similarity.masked_fill(~reference_mask[:, None, :], low).amax(dim=2)  # per candidate token
    best_candidate = similarity.masked_fill(~candidate_mask[:, :, None], low).amax(dim=1)  # per reference token
    precision = (best_reference * candidate_weights).sum(1) / candidate_weights.sum(1)
    recall = (best_candidate * reference_weights).sum(1) / reference_weights.sum(1)
    return precision, recall, 2 * precision * recall / (precision + recall)


class LLaVABertScoreLocal(RewardModel):
    """BERTScore recall (typically 0.5–0.9) of ``answer_template.format(prompt=...)`` against LLaVA's answer to
    ``question`` about each image; precision and F1 go to ``log_metric``. Not differentiable (the answer is generated
    text): it has no ``score``.

    Images reach LLaVA as 8-bit RGB through its image processor (the server's client sent JPEG at quality 80; here the
    pixels are not compressed).

    Args:
        model: a llava-hf ``LlavaForConditionalGeneration`` checkpoint (Hub id or directory) with its processor.
        scorer: the BERTScore encoder (``AutoModel``) and tokenizer; ``scorer_layer``: which hidden state it reads.
        prompt_template: the LLaVA prompt around ``{question}`` (llava-1.5's ``USER: <image>\\n... ASSISTANT:``).
        max_new_tokens: longest answer, in tokens (the server's 64); only its first sentence is scored.
    """

    name = "llava_bertscore_local"
    score = None  # generated text has no gradient: reward-backpropagation trainers refuse this reward by name

    def __init__(
        self,
        model: str = "llava-hf/llava-1.5-7b-hf",
        scorer: str = "microsoft/deberta-xlarge-mnli",
        scorer_layer: int = 40,
        question: str = "Answer concisely: what is going on in this image?",
        answer_template: str = "The image contains {prompt}",
        prompt_template: str = "USER: <image>\n{question} ASSISTANT:",
        max_new_tokens: int = 64,
        dtype: torch.dtype | str = torch.float16,
        batch_size: int = 8,
    ):
        super().__init__(dtype=dtype, batch_size=batch_size)
        self.model_location, self.scorer_location, self.scorer_layer = model, scorer, scorer_layer
        self.question, self.answer_template, self.prompt_template = question, answer_template, prompt_template
        self.max_new_tokens = max_new_tokens

    def _load(self, device: torch.device) -> None:
        from transformers import AutoModel, AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

        what = "LLaVA model"
        self.processor = from_pretrained(AutoProcessor.from_pretrained, self.model_location, what, self.name, "model")
        self.processor.tokenizer.padding_side = "left"  # generation continues every row from its last token
        self.llava = from_pretrained(
            LlavaForConditionalGeneration.from_pretrained,
            self.model_location,
            what,
            self.name,
            "model",
            dtype=self.dtype,
        )
        self.llava.to(device).eval().requires_grad_(False)
        what = "BERTScore model"
        self.scorer_tokenizer = from_pretrained(
            AutoTokenizer.from_pretrained, self.scorer_location, what, self.name, "scorer"
        )
        # BERTScore embeddings are compared by cosine in float32: the encoder runs in float32 unless float64.
        self.scorer = from_pretrained(
            AutoModel.from_pretrained, self.scorer_location, what, self.name, "scorer", dtype=self.compute_dtype
        )
        self.scorer.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def describe(self, images: torch.Tensor) -> list[str]:
        """LLaVA's answers (first sentence, greedy decoding) to ``question`` about (B, 3, H, W) images in [0, 1]."""
        self.load(images.device)
        text = self.prompt_template.format(question=self.question)
        pil = [Image.fromarray(array) for array in to_uint8(images)]
        inputs = self.processor(text=[text] * len(pil), images=pil, padding=True, return_tensors="pt")
        inputs = inputs.to(images.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        output = self.llava.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        answers = self.processor.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return [answer.split(".")[0].strip() + "." for answer in answers]  # the server keeps the first sentence

    @torch.no_grad()
    def bertscore(self, candidates: list[str], references: list[str]) -> tuple[torch.Tensor, ...]:
        """(precision, recall, F1), each (B,), of candidate vs reference sentences."""
        tokenizer = self.scorer_tokenizer

        def embed(sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            encoded = tokenizer([s.strip() for s in sentences], padding=True, truncation=True, return_tensors="pt").to(
                self.device
            )
            output = self.scorer(**encoded, output_hidden_states=True)
            mask = encoded["attention_mask"].bool()
            ids = encoded["input_ids"]
            special = torch.isin(
                ids, torch.tensor([tokenizer.cls_token_id, tokenizer.sep_token_id], device=ids.device)
            )
            weights = (mask & ~special).to(self.compute_dtype)
            return output.hidden_states[self.scorer_layer].to(self.compute_dtype), weights, mask

        cand, cand_weights, cand_mask = embed(candidates)
        ref, ref_weights, ref_mask = embed(references)
        return bertscore(cand, cand_weights, ref, ref_weights, cand_mask, ref_mask)

    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        return self._scores(prompts, images)[1]

    def _scores(self, prompts: list[str], images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        answers = self.describe(images)
        return self.bertscore(answers, [self.answer_template.format(prompt=prompt) for prompt in prompts])

    @torch.no_grad()
    def __call__(
        self, prompts: list[str], images: torch.Tensor, log_metric: Callable[[str, float], None] | None = None, **_
    ) -> list[float]:
        check_images(prompts, images, self.name)
        self.load(images.device)
        prompts = list(prompts)
        batches = [
            self._scores(prompts[start : start + self.batch_size], images[start : start + self.batch_size])
            for start in range(0, len(prompts), self.batch_size)
        ]
        precision, recall, f1 = (torch.cat(parts).float() for parts in zip(*batches))
        if log_metric is not None:
            log_metric(f"{self.__name__}/precision", precision.mean().item())
            log_metric(f"{self.__name__}/f1", f1.mean().item())
        return recall.cpu().tolist()
