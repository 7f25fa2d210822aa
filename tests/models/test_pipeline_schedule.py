"""The pipelines' sigma grids (dynamic/static shift, terminal stretch) in float64.

Checked against the equations and diffusers.
"""

import math

import pytest
import torch

from flowrl.models.pipeline_schedule import pipeline_sigmas, scheduler_mu


def _scheduler_grid(config, steps, seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    mu = scheduler_mu(config, seq_len) if config.get("use_dynamic_shifting") else None
    scheduler.set_timesteps(sigmas=[1.0 - i / steps for i in range(steps)], mu=mu)
    return scheduler.sigmas.double()


def test_equations_by_hand_float64():
    t = torch.tensor([1.0, 2 / 3, 1 / 3], dtype=torch.float64)
    cfg = {
        "use_dynamic_shifting": True,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "base_shift": 0.5,
        "max_shift": 1.15,
    }
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (1024 - 256)
    assert scheduler_mu(cfg, 1024) == pytest.approx(mu, abs=1e-15)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    torch.testing.assert_close(
        pipeline_sigmas(cfg, 3, 1024), torch.cat([shifted, torch.zeros(1, dtype=torch.float64)]), rtol=0, atol=1e-15
    )
    linear = pipeline_sigmas({**cfg, "time_shift_type": "linear"}, 3, 1024)
    torch.testing.assert_close(linear[:-1], mu / (mu + (1 / t - 1)), rtol=0, atol=1e-15)
    static = pipeline_sigmas({"shift": 3.0}, 3, 1024)
    torch.testing.assert_close(static[:-1], 3 * t / (1 + 2 * t), rtol=0, atol=1e-15)
    stretched = pipeline_sigmas({"shift": 3.0, "shift_terminal": 0.1}, 3, 1024)
    s = 3 * t / (1 + 2 * t)
    scale = (1 - s[-1]) / (1 - 0.1)
    torch.testing.assert_close(stretched[:-1], 1 - (1 - s) / scale, rtol=0, atol=1e-15)
    assert stretched[-2] == pytest.approx(0.1, abs=1e-15) and stretched[-1] == 0


@pytest.mark.parametrize(
    "config",
    [
        {
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
        {
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
            "shift_terminal": 0.02,
        },
        {"use_dynamic_shifting": True, "time_shift_type": "linear", "base_shift": 0.5, "max_shift": 1.15},
        {"shift": 3.0},
        {"shift": 1.0},
    ],
    ids=["flux-dev", "qwen-image", "linear-time-shift", "sd3-shift", "schnell"],
)
def test_matches_diffusers_scheduler(config):
    for steps, seq_len in ((1, 16), (4, 1024), (28, 4096)):
        ours = pipeline_sigmas(config, steps, seq_len)
        if steps == 1 and config.get("shift_terminal"):  # diffusers gives NaN here (0 / 0); flowrl keeps [1, 0]
            assert ours.tolist() == [1.0, 0.0]
            continue
        torch.testing.assert_close(ours, _scheduler_grid(config, steps, seq_len), rtol=0, atol=2e-6)


def test_unsupported_options_are_named():
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        pipeline_sigmas({"use_karras_sigmas": True}, 4, 16)
    with pytest.raises(ValueError, match="positive integer"):
        pipeline_sigmas({}, 0, 16)


@pytest.mark.parametrize("key", ["use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"])
def test_every_unsupported_scheduler_option_is_refused(key: str) -> None:
    """Each scheduler option flowrl does not reproduce is refused by name rather than silently ignored."""
    with pytest.raises(ValueError, match=f"scheduler option {key}=True is not supported"):
        pipeline_sigmas({"shift": 3.0, key: True}, 4, 16)
    assert pipeline_sigmas({"shift": 3.0, key: False}, 4, 16).shape == (5,)


def test_mu_defaults_are_the_flux_pipeline_s() -> None:
    """Missing config keys default as FluxPipeline reads them: mu runs from 0.5 at 256 tokens to 1.15 at 4096."""
    assert scheduler_mu({}, 256) == pytest.approx(0.5, abs=1e-15)
    assert scheduler_mu({}, 4096) == pytest.approx(1.15, abs=1e-15)
    assert scheduler_mu({}, 1024) == pytest.approx(0.5 + 0.65 * 768 / 3840, abs=1e-15)
