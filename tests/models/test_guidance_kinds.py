"""Which adapters get true CFG: SD3/Wan/Qwen-Image ("cfg") are wrapped, FLUX.1-dev ("distilled") and
FLUX.1-schnell ("none") never are; a CFG scale for them is a one-line error."""

import pytest
from tiny_flow_pipelines import tiny_flux, tiny_qwen_image
from tiny_wan import tiny_wan_adapter

from flowrl.models.adapter import GUIDANCE_KINDS
from flowrl.policy.guidance import GuidedAdapter, apply_guidance


def test_every_adapter_declares_its_guidance_kind(tiny_sd3):
    kinds = {
        "sd3": tiny_sd3.guidance,
        "wan": tiny_wan_adapter().guidance,
        "qwen": tiny_qwen_image().guidance,
        "flux-dev": tiny_flux().guidance,
        "flux-schnell": tiny_flux(guidance_embeds=False).guidance,
    }
    assert set(kinds.values()) <= set(GUIDANCE_KINDS)
    assert kinds == {"sd3": "cfg", "wan": "cfg", "qwen": "cfg", "flux-dev": "distilled", "flux-schnell": "none"}


def test_cfg_wraps_only_true_cfg_adapters(tiny_sd3):
    for model in (tiny_sd3, tiny_wan_adapter(), tiny_qwen_image()):
        assert isinstance(apply_guidance(model, 4.5, "blurry"), GuidedAdapter)
        assert apply_guidance(model, 1.0, "blurry") is model
    dev, schnell = tiny_flux(), tiny_flux(guidance_embeds=False)
    assert apply_guidance(dev, 1.0) is dev and apply_guidance(schnell, 1.0) is schnell
    with pytest.raises(ValueError, match="distilled guidance.*model.distilled_guidance"):
        apply_guidance(dev, 3.5)
    with pytest.raises(ValueError, match="no guidance"):
        apply_guidance(schnell, 3.5)
