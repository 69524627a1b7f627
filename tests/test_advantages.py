import pytest
import torch

from trl_dance.advantages import group_advantages


def test_group_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, 4)
    mean, std = 3.0, torch.tensor([1.0, 2.0, 3.0, 6.0]).std().item()  # unbiased std
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 2.0, 3.0, 6.0]) - mean) / (std + 1e-8))
    assert torch.equal(adv[4:], torch.zeros(4))  # constant group: zero, not NaN


def test_batch_and_no_scaling_and_clipping():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    batch = group_advantages(rewards, 2, scale_rewards="batch")
    torch.testing.assert_close(batch, torch.tensor([-0.5, 0.5, -10.0, 10.0]) / (rewards.view(-1, 2).std() + 1e-4))
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
