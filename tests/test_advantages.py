import pytest
import torch

from trl_dance.advantages import PerPromptStatTracker, group_advantages


def test_group_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, 4)
    mean, std = 3.0, torch.tensor([1.0, 2.0, 3.0, 6.0]).std().item()  # unbiased std
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 2.0, 3.0, 6.0]) - mean) / (std + 1e-8))
    assert torch.equal(adv[4:], torch.zeros(4))  # constant group: zero, not NaN


def test_batch_and_no_scaling_and_clipping():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    batch = group_advantages(rewards, 2, scale_rewards="batch")
    std = rewards.std(correction=0)  # np.std, as Flow-GRPO and DiffusionNFT
    torch.testing.assert_close(batch, torch.tensor([-0.5, 0.5, -10.0, 10.0]) / (std + 1e-4))
    assert torch.equal(
        group_advantages(rewards, 2, scale_rewards="none", clip=None), torch.tensor([-0.5, 0.5, -10.0, 10.0])
    )
    assert torch.equal(
        group_advantages(rewards, 2, scale_rewards="none", clip=5.0), torch.tensor([-0.5, 0.5, -5.0, 5.0])
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="shape"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, scale_rewards="global")


def test_per_prompt_stat_tracker_matches_hand_computation():
    tracker = PerPromptStatTracker(buffer_size=3, min_count=2, epsilon=0.0)
    # Round 1: "a" has 1 reward (< min_count) -> batch statistics; "b" has 2 -> its own buffer.
    rewards = torch.tensor([1.0, 2.0, 4.0])
    adv = tracker(["a", "b", "b"], rewards, clip=None)
    batch_mean, batch_std = 7 / 3, torch.tensor([1.0, 2.0, 4.0]).std(correction=0).item()
    assert adv[0].item() == pytest.approx((1 - batch_mean) / batch_std, rel=1e-6)
    torch.testing.assert_close(adv[1:], torch.tensor([-1.0, 1.0]))  # (2 - 3) / 1, (4 - 3) / 1
    # Round 2: "a" now has [1, 3] -> mean 2, std 1; "b"'s buffer keeps the last 3: [2, 4, 6] -> mean 4, std sqrt(8/3).
    adv = tracker(["a", "b"], torch.tensor([3.0, 6.0]), clip=None)
    assert adv[0].item() == pytest.approx(1.0)
    assert adv[1].item() == pytest.approx((6 - 4) / (8 / 3) ** 0.5, rel=1e-6)
    assert list(tracker.buffers["b"]) == [2.0, 4.0, 6.0]
    restored = PerPromptStatTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.buffers == tracker.buffers and restored.min_count == 2
    assert tracker(["c", "c"], torch.tensor([0.0, 100.0]), clip=5.0).abs().max() <= 5.0
