"""The policy's forward process, one implementation per parametrisation (flow velocity, ε, v): closed forms."""

import pytest
import torch

from trl_dance.policies import SamplerSettings, make_policy
from trl_dance.testing import TINY_PIPELINES


@pytest.mark.parametrize("kind", ["flux", "sd3", "sd", "sd2"])  # flow (dynamic shift), flow (shift 3), ε, v
def test_exact_prediction_moves_along_the_forward_process(kind):
    """With the exact training target as the model's output, the deterministic step from t to t' lands on the forward
    process at t' (Euler for flow; DDIM η = 0 for ε and v), and the known noise recovers x0 exactly."""
    policy = make_policy(TINY_PIPELINES[kind](0), SamplerSettings(num_inference_steps=4, height=32, width=32))
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(6, 4, 4, 4, generator=generator), torch.randn(6, 4, 4, 4, generator=generator)
    t = policy.process.sample_training_times(6, generator, "cpu")
    t_next = t * torch.rand(6, generator=generator)
    assert t.dtype == torch.float32 and ((t >= 0) & (t <= 1)).all()
    noisy = policy.process.add_noise(x0, noise, t)
    alpha, sigma = policy.process.noise_coefficients(t)
    torch.testing.assert_close(alpha**2 + sigma**2 if kind in ("sd", "sd2") else alpha + sigma, torch.ones(6))
    torch.testing.assert_close(policy.process.recover_clean(noisy, noise, t), x0, atol=1e-4, rtol=1e-4)
    target = policy.process.training_target(x0, noise, t)
    step = policy.process.deterministic_step(target, noisy, t, t_next)
    torch.testing.assert_close(step, policy.process.add_noise(x0, noise, t_next), atol=1e-4, rtol=1e-4)
    expected = {"flux": "flow_prediction", "sd3": "flow_prediction", "sd": "epsilon", "sd2": "v_prediction"}[kind]
    assert policy.prediction_type == expected


def test_vp_times_address_the_training_timesteps_exactly():
    """ε/v models: t = k / (T − 1) feeds the denoiser the integer timestep k, for every k."""
    policy = make_policy(TINY_PIPELINES["sd"](0), SamplerSettings(num_inference_steps=4, height=32, width=32))
    steps = policy.process.scheduler.config.num_train_timesteps
    k = torch.arange(steps)
    assert torch.equal(policy.process.timestep_at(k / (steps - 1)), k)
    draws = policy.process.sample_training_times(4096, torch.Generator().manual_seed(0), "cpu")
    assert (
        set(policy.process.timestep_at(draws).tolist()) <= set(range(steps))
        and draws.min() < 0.01
        and draws.max() > 0.99
    )
