"""Every built-in reward passes the conformance kit; the kit catches broken rewards."""

import socket

import pytest
import torch
from tiny_reward_weights import build_tiny_weights

from flowrl.rewards import digit_correctness, ink, jpeg_compressibility, jpeg_incompressibility
from flowrl.rewards.aesthetic import aesthetic
from flowrl.rewards.clipscore import clipscore
from flowrl.rewards.hpsv2 import hpsv2
from flowrl.rewards.imagereward import imagereward
from flowrl.rewards.pickscore import pickscore
from flowrl.rewards.testing import ConformanceError, check_reward


@pytest.fixture(scope="module")
def tiny_model_weights(tmp_path_factory):
    """Factory options of every model reward, pointing at tiny random weights in the published layouts."""
    return build_tiny_weights(tmp_path_factory.mktemp("tiny-reward-weights"))


@pytest.mark.parametrize(
    "factory, options",
    [
        (digit_correctness, {}),
        (ink, {"target": "bold"}),
        (ink, {"target": "thin"}),
        (ink, {"target": "prompt"}),
        (jpeg_compressibility, {}),
        (jpeg_incompressibility, {}),
        (pickscore, "pickscore"),
        (clipscore, "clipscore"),
        (aesthetic, "aesthetic"),
        (hpsv2, "hpsv2"),
        (imagereward, "imagereward"),
    ],
)
def test_builtin_rewards_conform(factory, options, request):
    if isinstance(options, str):  # a model reward: tiny weights saved in its published layout
        options = request.getfixturevalue("tiny_model_weights")[options]
    scores = check_reward(factory, options=options)
    assert scores.shape == (4,) and scores.dtype == torch.float32


def _factory(body):
    def factory():
        def broken(images, prompts, **metadata):
            return body(images)

        return broken

    return factory


@pytest.mark.parametrize(
    "body, fragment",
    [
        (lambda x: torch.rand(x.shape[0]), "not deterministic"),
        (lambda x: x.mean(dim=(1, 2, 3)), "requires grad"),
        (lambda x: torch.zeros(x.shape[0], 1), "shape"),
    ],
)
def test_kit_catches_broken_rewards(body, fragment):
    with pytest.raises(ConformanceError if fragment != "shape" else ValueError, match=fragment):
        check_reward(_factory(body), name="broken")


def test_kit_catches_network_access():
    def factory():
        def phoning(images, prompts, **metadata):
            socket.create_connection(("127.0.0.1", 9), timeout=0.1)
            return torch.zeros(images.shape[0])

        return phoning

    with pytest.raises(ValueError, match="network"):
        check_reward(factory, name="phoning")


def test_video_check():
    def factory():
        def frame_mean(images, prompts, **metadata):
            x = images if images.ndim == 4 else images.mean(dim=1)
            return x.detach().mean(dim=(1, 2, 3)).float()

        return frame_mean

    check_reward(factory, video=True)
    with pytest.raises(ConformanceError, match="video"):
        check_reward(
            _factory(lambda x: x.detach().flatten(1).mean(1).float() if x.ndim == 4 else torch.zeros(2, 2)), video=True
        )
