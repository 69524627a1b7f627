import math

import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from trl_dance.schedulers import ddim_alpha_pairs, flow_match_sigmas, patch_scheduler
from trl_dance.sde import (
    dance_sigmas,
    ddim_sde_step,
    diffusion_target,
    epsilon_and_x0,
    flow_dpm_solver_step,
    flow_sde_step,
)

SHAPE = (3, 4, 5, 6)


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


def _gaussian_logprob64(x, mean, std):
    return (-((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))


@pytest.mark.parametrize("sde_type", ["dance", "flow_grpo"])
def test_flow_step_matches_float64_closed_form(sde_type):
    v, x = _inputs()
    sigma, sigma_next, eta = 0.7, 0.55, 0.3
    out = flow_sde_step(
        v, x, sigma, sigma_next, sde_type=sde_type, eta=eta, generator=torch.Generator().manual_seed(1)
    )

    v64, x64 = v.double(), x.double()
    s = eta if sde_type == "dance" else eta * math.sqrt(sigma / (1 - sigma))
    delta = sigma - sigma_next
    eps_hat = x64 + (1 - sigma) * v64
    mean = x64 - delta * (v64 + s**2 / (2 * sigma) * eps_hat)
    std = s * math.sqrt(delta)
    torch.testing.assert_close(out.mean.double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.std.double(), torch.full((3,), std, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    expected = _gaussian_logprob64(out.prev_sample.double(), mean, std)
    torch.testing.assert_close(out.log_prob.double(), expected, atol=1e-5, rtol=1e-5)
    assert out.log_prob.shape == (3,) and out.log_prob.dtype == torch.float32


def test_sum_reduction_is_mean_times_elements():
    v, x = _inputs()
    g = torch.Generator().manual_seed(3)
    mean_out = flow_sde_step(v, x, 0.8, 0.6, generator=g)
    sum_out = flow_sde_step(v, x, 0.8, 0.6, prev_sample=mean_out.prev_sample, reduction="sum")
    torch.testing.assert_close(sum_out.log_prob, mean_out.log_prob * (4 * 5 * 6), rtol=1e-5, atol=1e-3)


def test_cps_step_matches_closed_form():
    v, x = _inputs()
    sigma, sigma_next, a = 0.6, 0.4, 0.5
    out = flow_sde_step(v, x, sigma, sigma_next, sde_type="cps", eta=a)
    x0 = x.double() - sigma * v.double()
    eps = x.double() + (1 - sigma) * v.double()
    std = sigma_next * math.sin(a * math.pi / 2)
    mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps
    torch.testing.assert_close(out.mean.double(), mean, atol=1e-5, rtol=1e-5)
    pseudo = -((out.prev_sample.double() - mean) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), pseudo, atol=1e-5, rtol=1e-5)


def test_ddim_step_matches_float64_closed_form():
    eps, x = _inputs()
    a_t, a_prev, eta = 0.3, 0.5, 1.0
    out = ddim_sde_step(eps, x, a_t, a_prev, eta=eta, generator=torch.Generator().manual_seed(2))
    e64, x64 = eps.double(), x.double()
    x0 = (x64 - math.sqrt(1 - a_t) * e64) / math.sqrt(a_t)
    std = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    mean = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - std**2) * e64
    torch.testing.assert_close(out.mean.double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        out.log_prob.double(), _gaussian_logprob64(out.prev_sample.double(), mean, std), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_zero_noise_flow_step_equals_diffusers_euler(shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(8)
    sigmas = flow_match_sigmas(scheduler)
    assert sigmas[-1] == 0 and len(sigmas) == 9
    v, x = _inputs()
    for i in (0, 3, 7):
        scheduler._step_index = i
        expected = scheduler.step(v, scheduler.timesteps[i], x).prev_sample
        out = flow_sde_step(v, x, sigmas[i], sigmas[i + 1], eta=0.0, compute_log_prob=False)
        torch.testing.assert_close(out.prev_sample, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out.mean, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize(("set_alpha_to_one", "clip_sample"), [(False, False), (True, False), (False, True)])
def test_zero_noise_ddim_step_equals_diffusers_ddim(prediction_type, set_alpha_to_one, clip_sample):
    """Every prediction type (SD 2.x 768 predicts v), the last step's ᾱ_{t'} = final_alpha_cumprod, clip_sample."""
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        set_alpha_to_one=set_alpha_to_one,
        steps_offset=1,
        clip_sample=clip_sample,
        clip_sample_range=0.5,
        prediction_type=prediction_type,
    )
    scheduler.set_timesteps(10)
    alpha_t, alpha_prev = ddim_alpha_pairs(scheduler)
    output, x = _inputs()
    for i in (0, 4, 9):
        t = scheduler.timesteps[i]
        expected = scheduler.step(output, t, x, eta=0.0).prev_sample
        out = ddim_sde_step(
            output,
            x,
            alpha_t[i],
            alpha_prev[i],
            eta=0.0,
            prediction_type=prediction_type,
            clip_sample_range=0.5 if clip_sample else None,
            compute_log_prob=False,
        )
        torch.testing.assert_close(out.prev_sample, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_diffusion_target_inverts_the_prediction(prediction_type):
    """The training target at x_t = √ᾱ x0 + √(1 − ᾱ) ε, read back by epsilon_and_x0, gives (ε, x0) again."""
    x0, noise = torch.randn(2, 2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).unbind(0)
    alpha = torch.tensor([0.3, 0.9], dtype=torch.float64).view(2, 1, 1)
    x_t = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
    target = diffusion_target(x0, noise, alpha, prediction_type)
    eps, x0_hat = epsilon_and_x0(target, x_t, alpha, prediction_type)
    torch.testing.assert_close(eps.double(), noise, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x0_hat.double(), x0, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prediction_type must be one of"):
        diffusion_target(x0, noise, alpha, "flow_prediction")


def test_ddim_eta_std_equals_diffusers_variance():
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, set_alpha_to_one=False, steps_offset=1
    )
    scheduler.set_timesteps(10)
    alpha_t, alpha_prev = ddim_alpha_pairs(scheduler)
    eps, x = _inputs()
    for i in (1, 5):
        t = int(scheduler.timesteps[i])
        variance = scheduler._get_variance(t, t - 100)
        out = ddim_sde_step(eps, x, alpha_t[i], alpha_prev[i], eta=1.0)
        torch.testing.assert_close(out.std, torch.full((3,), float(variance.sqrt())), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sde_type", ["dance", "flow_grpo"])
def test_sample_statistics_match_mean_and_std(sde_type):
    v = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0)).expand(4000, -1, -1, -1)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1)).expand(4000, -1, -1, -1)
    out = flow_sde_step(v, x, 0.6, 0.4, sde_type=sde_type, eta=0.7, generator=torch.Generator().manual_seed(2))
    std = out.std[0]
    emp_mean = out.prev_sample.mean(0)
    emp_std = out.prev_sample.std(0)
    # Standard error of the mean is std/sqrt(4000) ~ 1.6% of std; allow 5 standard errors.
    assert (emp_mean - out.mean[0]).abs().max() < 5 * std / math.sqrt(4000)
    assert (emp_std / std - 1).abs().max() < 0.08
    # The average log-density of the samples is the negative entropy of the Gaussian.
    entropy = 0.5 * math.log(2 * math.pi * math.e) + math.log(float(std))
    assert abs(float(out.log_prob.mean()) + entropy) < 0.01


def test_rescoring_the_sample_returns_the_same_log_prob():
    v, x = _inputs()
    first = flow_sde_step(v, x, 0.9, 0.8, generator=torch.Generator().manual_seed(5))
    again = flow_sde_step(v, x, 0.9, 0.8, prev_sample=first.prev_sample)
    assert torch.equal(again.log_prob, first.log_prob)
    assert torch.equal(again.prev_sample, first.prev_sample)


def test_bf16_inputs_give_float32_outputs():
    v, x = _inputs(dtype=torch.bfloat16)
    out = flow_sde_step(v, x, 0.5, 0.4)
    assert out.prev_sample.dtype == out.mean.dtype == out.log_prob.dtype == out.std.dtype == torch.float32
    ref = flow_sde_step(v.float(), x.float(), 0.5, 0.4, prev_sample=out.prev_sample)
    torch.testing.assert_close(out.log_prob, ref.log_prob)


def test_flow_grpo_at_sigma_one_is_finite_and_needs_sigma_max():
    v, x = _inputs()
    out = flow_sde_step(v, x, 1.0, 0.9, sde_type="flow_grpo", eta=0.7, sigma_max=0.9)
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()
    torch.testing.assert_close(out.std, torch.full((3,), 0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1)))
    with pytest.raises(ValueError, match="sigma_max"):
        flow_sde_step(v, x, 1.0, 0.9, sde_type="flow_grpo")


@pytest.mark.parametrize("sde_type", ["dance", "flow_grpo", "cps"])
def test_per_sample_sigmas_equal_scalar_calls(sde_type):
    v, x = _inputs()
    sigma = torch.tensor([1.0, 0.7, 0.3])
    sigma_next = torch.tensor([0.9, 0.5, 0.1])
    batched = flow_sde_step(
        v, x, sigma, sigma_next, sde_type=sde_type, sigma_max=0.9, generator=torch.Generator().manual_seed(0)
    )
    for i in range(3):
        single = flow_sde_step(
            v[i : i + 1],
            x[i : i + 1],
            float(sigma[i]),
            float(sigma_next[i]),
            sde_type=sde_type,
            sigma_max=0.9,
            prev_sample=batched.prev_sample[i : i + 1],
        )
        torch.testing.assert_close(single.mean, batched.mean[i : i + 1])
        torch.testing.assert_close(single.log_prob, batched.log_prob[i : i + 1])


def test_zero_noise_log_prob_is_a_clear_error():
    v, x = _inputs()
    with pytest.raises(ValueError, match="zero standard deviation"):
        flow_sde_step(v, x, 0.5, 0.4, eta=0.0)
    with pytest.raises(ValueError, match="zero standard deviation"):
        ddim_sde_step(v, x, 0.3, 0.5, eta=0.0)
    with pytest.raises(ValueError, match="sde_type"):
        flow_sde_step(v, x, 0.5, 0.4, sde_type="ode")
    with pytest.raises(ValueError, match="shape"):
        flow_sde_step(v, x, torch.tensor([0.5, 0.4]), 0.3)


def test_dance_sigmas():
    sigmas = dance_sigmas(16, shift=3.0)
    assert sigmas.shape == (17,) and sigmas[0] == 1 and sigmas[-1] == 0
    assert (sigmas[1:] < sigmas[:-1]).all()
    u = 1 - 4 / 16
    assert abs(float(sigmas[4]) - 3 * u / (1 + 2 * u)) < 1e-7
    torch.testing.assert_close(dance_sigmas(10, shift=1.0), torch.linspace(1, 0, 11))


def test_patch_scheduler_flow_matches_function_and_keeps_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    plain = scheduler.step
    patch_scheduler(scheduler, sde_type="flow_grpo", eta=0.7)
    assert scheduler.step == plain
    sigmas = flow_match_sigmas(scheduler)
    v, x = _inputs()
    for i in (0, 2):
        out = scheduler.step_with_logprob(v, scheduler.timesteps[i], x, generator=torch.Generator().manual_seed(0))
        ref = flow_sde_step(
            v,
            x,
            sigmas[i],
            sigmas[i + 1],
            sde_type="flow_grpo",
            eta=0.7,
            sigma_max=sigmas[1],
            prev_sample=out.prev_sample,
        )
        torch.testing.assert_close(out.log_prob, ref.log_prob)
    # The ordinary step still runs the deterministic Euler update.
    scheduler._step_index = 0
    torch.testing.assert_close(
        scheduler.step(v, scheduler.timesteps[0], x).prev_sample, x + (sigmas[1] - sigmas[0]) * v
    )


def test_patch_scheduler_ddim_matches_function():
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, set_alpha_to_one=False, steps_offset=1
    )
    scheduler.set_timesteps(10)
    patch_scheduler(scheduler)
    alpha_t, alpha_prev = ddim_alpha_pairs(scheduler)
    eps, x = _inputs()
    out = scheduler.step_with_logprob(eps, scheduler.timesteps[3], x, generator=torch.Generator().manual_seed(0))
    # DDIMScheduler's defaults clip x̂0 to [-1, 1]; the patched step honours it.
    ref = ddim_sde_step(eps, x, alpha_t[3], alpha_prev[3], eta=1.0, clip_sample_range=1.0, prev_sample=out.prev_sample)
    torch.testing.assert_close(out.log_prob, ref.log_prob)
    with pytest.raises(TypeError):
        patch_scheduler(object())


@pytest.mark.parametrize("steps", [4, 7, 20])
def test_flow_dpm_solver_matches_diffusers(steps):
    """DPM-Solver++(2M) of MixGRPO-Flash equals diffusers' DPMSolverMultistepScheduler (flow sigmas, flow prediction,
    midpoint, first-order last step onto σ = 0) on the same grid, along a whole solve of a smooth velocity field."""
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        solver_order=2,
        algorithm_type="dpmsolver++",
        lower_order_final=False,
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(steps)
    sigmas = scheduler.sigmas.tolist()
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 4, 8, generator=g), 0.3 * torch.randn(4, 4, generator=g)

    def velocity(latents, sigma):
        return torch.tanh(torch.einsum("ij,bjk->bik", weight, latents)) * (1 + sigma) - latents * sigma

    theirs, ours, previous = x.clone(), x.clone(), None
    for i, t in enumerate(scheduler.timesteps):
        theirs = scheduler.step(velocity(theirs, sigmas[i]), t, theirs).prev_sample
        x0_hat = ours - sigmas[i] * velocity(ours, sigmas[i])
        ours, previous = flow_dpm_solver_step(x0_hat, ours, sigmas[i], sigmas[i + 1], previous), (x0_hat, sigmas[i])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_flow_dpm_solver_from_pure_noise_is_euler():
    x, v = _inputs()
    x0_hat = x - v
    torch.testing.assert_close(flow_dpm_solver_step(x0_hat, x, 1.0, 0.8), x - 0.2 * v)
    # The next step has no usable history (λ(1) = −∞) and is first order.
    x1 = x - 0.2 * v
    first = flow_dpm_solver_step(x1 - 0.8 * v, x1, 0.8, 0.5)
    torch.testing.assert_close(flow_dpm_solver_step(x1 - 0.8 * v, x1, 0.8, 0.5, (x0_hat, 1.0)), first)
