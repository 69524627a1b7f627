"""The local LLaVA + BERTScore reward on tiny llava-hf and DeBERTa checkpoints: BERTScore against a loop over tokens,
LLaVA's answers against a token-by-token greedy decode."""

import pytest
import torch
from PIL import Image
from reward_checkpoints import save_tiny_deberta, save_tiny_llava
from transformers import AutoModel, AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from trl_dance.rewards import LLaVABertScoreLocal, get_reward_function
from trl_dance.rewards.image_transforms import to_uint8

PROMPTS = ["a cat", "a red house by the sea", "blue sky"]


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-bertscore")
    llava, deberta = save_tiny_llava(str(root / "llava")), save_tiny_deberta(str(root / "deberta"))
    return LLaVABertScoreLocal(model=llava, scorer=deberta, scorer_layer=2, max_new_tokens=12, dtype=torch.float32)


def _images(count=3, seed=0):
    return torch.rand((count, 3, 32, 32), generator=torch.Generator().manual_seed(seed))


def test_bertscore_matches_token_loop(reward):
    candidates = ["a small dog.", "The image contains a red house by the sea."]
    references = ["The image contains a cat", "The image contains a red house by the sea"]
    reward.load("cpu")
    precision, recall, f1 = reward.bertscore(candidates, references)

    tokenizer = AutoTokenizer.from_pretrained(reward.scorer_location)
    model = AutoModel.from_pretrained(reward.scorer_location).eval()
    for row, (candidate, reference) in enumerate(zip(candidates, references)):
        with torch.no_grad():  # one sentence at a time: no padding at all
            c = model(**tokenizer(candidate, return_tensors="pt"), output_hidden_states=True).hidden_states[2][0]
            r = model(**tokenizer(reference, return_tensors="pt"), output_hidden_states=True).hidden_states[2][0]
        cos = [[float(torch.cosine_similarity(u, v, dim=0)) for v in r] for u in c]
        # [CLS]/[SEP] (first and last) are matched against but carry no weight of their own.
        p = sum(max(cos[i]) for i in range(1, len(c) - 1)) / (len(c) - 2)
        rc = sum(max(cos[i][j] for i in range(len(c))) for j in range(1, len(r) - 1)) / (len(r) - 2)
        assert precision[row].item() == pytest.approx(p, abs=1e-5)
        assert recall[row].item() == pytest.approx(rc, abs=1e-5)
        assert f1[row].item() == pytest.approx(2 * p * rc / (p + rc), abs=1e-5)
    same = reward.bertscore(["The image contains a cat"], ["The image contains a cat"])
    assert all(value.item() == pytest.approx(1.0, abs=1e-5) for value in same)


def test_answers_are_greedy_first_sentences(reward):
    images = _images()
    answers = reward.describe(images)

    processor = AutoProcessor.from_pretrained(reward.model_location)
    model = LlavaForConditionalGeneration.from_pretrained(reward.model_location).eval()
    text = "USER: <image>\nAnswer concisely: what is going on in this image? ASSISTANT:"
    for image, answer in zip(to_uint8(images), answers):
        inputs = processor(text=[text], images=[Image.fromarray(image)], return_tensors="pt")
        ids, tokens = inputs["input_ids"], []
        for _ in range(12):  # argmax of the full forward at every step, no cache
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, -1]
            token = int(logits.argmax())
            if token == processor.tokenizer.eos_token_id:
                break
            tokens.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        decoded = processor.tokenizer.decode(tokens, skip_special_tokens=True)
        assert answer == decoded.split(".")[0].strip() + "."


def test_reward_is_recall_and_logs_precision_f1(reward):
    images = _images(seed=1)
    logged = {}
    values = reward(PROMPTS, images, log_metric=lambda name, value: logged.setdefault(name, value))
    precision, recall, f1 = reward.bertscore(reward.describe(images), [f"The image contains {p}" for p in PROMPTS])
    torch.testing.assert_close(torch.tensor(values), recall.float(), atol=1e-6, rtol=0)
    assert logged["llava_bertscore_local/precision"] == pytest.approx(precision.mean().item(), abs=1e-6)
    assert logged["llava_bertscore_local/f1"] == pytest.approx(f1.mean().item(), abs=1e-6)
    assert reward.batch_size == 8 and len(values) == 3
    small = LLaVABertScoreLocal(reward.model_location, reward.scorer_location, 2, max_new_tokens=12, batch_size=2)
    small.dtype = torch.float32
    torch.testing.assert_close(torch.tensor(small(PROMPTS, images)), torch.tensor(values), atol=1e-5, rtol=0)
    # Generated text has no gradient: the reward-backpropagation trainers' check finds no score().
    assert not callable(getattr(reward, "score", None))
    assert isinstance(get_reward_function("llava_bertscore_local", model="x"), LLaVABertScoreLocal)
