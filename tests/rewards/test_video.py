"""Video rewards: frame-aggregated image rewards and temporal consistency."""

import math

import pytest
import torch

from flowrl.rewards import RewardError, build_multi_reward, build_reward, ink, reduce_frames
from flowrl.rewards.testing import check_reward, default_batch
from flowrl.rewards.video import frame_differences, temporal_consistency


def clips(batch=4, frames=3, size=8, seed=0):
    return torch.rand(batch, frames, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_reduce_frames_ignores_nan_frames():
    nan = math.nan
    scores = torch.tensor([[1.0, 3.0, 2.0], [nan, 4.0, 0.5], [nan, nan, nan]], dtype=torch.float64)
    mean, low = reduce_frames(scores, "mean"), reduce_frames(scores, "min")
    assert mean[:2].tolist() == [2.0, 2.25] and math.isnan(mean[2])
    assert low[:2].tolist() == [1.0, 0.5] and math.isnan(low[2])
    with pytest.raises(ValueError, match="one of"):
        reduce_frames(scores, "max")


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_frame_reward_matches_per_frame_scores(reduce):
    x = clips()
    prompts = ["a bold handwritten 1", "a thin handwritten 2", "a bold handwritten 3", "a handwritten 4"]
    reward = build_reward("ink", target="prompt", video=reduce)
    per_frame = torch.stack([ink("prompt")(x[:, t], prompts) for t in range(x.shape[1])], dim=1)
    expected = per_frame.nanmean(1) if reduce == "mean" else per_frame.amin(1)
    got = reward(x, prompts)
    assert got.dtype == torch.float32 and reward.allows_nan
    assert torch.allclose(got[:3], expected[:3], atol=1e-7) and math.isnan(got[3])  # no style word: not applicable
    # metadata is repeated per frame; an image batch is a clip of one frame
    styled = reward(x, prompts, style=["thin", "bold", "thin", "bold"])
    ink_per_frame = x.mean(dim=(2, 3, 4))  # (B, F)
    signed = torch.stack([1 - ink_per_frame[0], ink_per_frame[1], 1 - ink_per_frame[2], ink_per_frame[3]])
    assert torch.allclose(styled, signed.mean(1) if reduce == "mean" else signed.amin(1), atol=1e-6)
    image, reference = reward(x[:, 0], prompts), ink("prompt")(x[:, 0], prompts)
    assert torch.equal(image.isnan(), reference.isnan()) and torch.equal(image.nan_to_num(), reference.nan_to_num())


@pytest.mark.parametrize(
    "name, options", [("ink", {"target": "bold"}), ("digit_correctness", {}), ("jpeg_compressibility", {})]
)
@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_frame_rewards_conform_with_video(name, options, reduce):
    scores = check_reward(
        lambda **o: build_reward(name, **o), name=f"{name}/{reduce}", options={**options, "video": reduce}, video=True
    )
    assert scores.shape == (4,)


def test_temporal_consistency_formula_float64():
    x = clips(batch=2, frames=4, size=8, seed=1).double()
    fn = temporal_consistency(size=None)
    expected = torch.stack(
        [1 - torch.stack([(x[b, t + 1] - x[b, t]).abs().mean() for t in range(3)]).mean() for b in range(2)]
    )
    assert torch.allclose(fn(x, ["p", "p"]).double(), expected, atol=1e-6)
    worst = temporal_consistency(size=None, reduce="min")(x, ["p", "p"])
    assert torch.allclose(worst.double(), 1 - frame_differences(x).amax(1).double(), atol=1e-6)
    # area downsample: a 2x2 checkerboard that swaps phase each frame is flicker at full size, still at size 1
    board = (torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2
    flicker = torch.stack([board, 1 - board]).float()[None, :, None].expand(1, 2, 3, 8, 8)
    assert temporal_consistency(size=None)(flicker, ["p"]).item() == 0.0
    assert temporal_consistency(size=1)(flicker, ["p"]).item() == 1.0


def test_temporal_consistency_conforms_and_orders_clips():
    still = clips(batch=2, frames=1).expand(2, 5, 3, 8, 8).contiguous()
    noisy = clips(batch=2, frames=5, seed=3)
    fn = temporal_consistency()
    assert torch.equal(fn(still, ["a", "b"]), torch.ones(2))
    assert (fn(noisy, ["a", "b"]) < 0.9).all()
    images, prompts, metadata = default_batch()
    video = torch.stack([images, images.flip(-1), images], dim=1)
    check_reward(temporal_consistency, images=video, prompts=prompts, metadata=metadata, video=True)
    with pytest.raises(ValueError, match="F >= 2"):
        fn(images, prompts)
    with pytest.raises(ValueError, match="positive integer"):
        temporal_consistency(size=0)


def test_video_rewards_in_a_config_spec():
    spec = {"ink": {"target": "bold", "video": "min"}, "temporal_consistency": {"weight": 0.5, "size": 4}}
    reward = build_multi_reward(spec)
    x = clips(frames=3)
    out = reward(x, ["a bold handwritten 1"] * 4, batch_index=2)
    expected = x.mean(dim=(2, 3, 4)).amin(1) + 0.5 * temporal_consistency(size=4)(x, ["p"] * 4)
    assert torch.allclose(out.total, expected, atol=1e-6)
    with pytest.raises(ValueError, match="option video must be one of"):
        build_multi_reward({"ink": {"video": "max"}})
    with pytest.raises(
        RewardError, match=r"reward 'ink' \(batch 2\) raised ValueError: images must have shape \(B, 3, H, W\)"
    ):
        build_multi_reward({"ink": {"target": "bold"}})(x, ["p"] * 4, batch_index=2)


def test_frame_reward_names_a_broken_image_reward():
    def per_clip(images, prompts, **metadata):
        return torch.zeros(2)

    from flowrl.rewards import MultiReward, frame_reward

    reward = MultiReward({"broken": (frame_reward(per_clip, "mean", "broken"), 1.0)})
    with pytest.raises(
        RewardError, match=r"reward 'broken' \(batch 5\) raised ValueError: .* returned \(2,\) for 4 clips x 3 frames"
    ):
        reward(clips(), ["p"] * 4, batch_index=5)


@pytest.fixture(scope="module")
def tiny_model_weights(tmp_path_factory):
    from tiny_reward_weights import build_tiny_weights

    return build_tiny_weights(tmp_path_factory.mktemp("tiny-reward-weights"))


@pytest.mark.slow  # builds every tiny model reward (about 20 s on the shared 2-core machine)
@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward"])
def test_model_rewards_score_video_frame_by_frame(name, tiny_model_weights):
    options = tiny_model_weights[name]
    scores = check_reward(
        lambda **o: build_reward(name, **o), name=f"{name}/video", options={**options, "video": "mean"}, video=True
    )
    images, prompts, _ = default_batch()
    clip = torch.stack([images, images.flip(-1)], dim=1)  # two different frames per clip
    image_reward = build_reward(name, **options)
    expected = (image_reward(clip[:, 0], prompts) + image_reward(clip[:, 1], prompts)) / 2
    assert torch.allclose(build_reward(name, **options, video="mean")(clip, prompts), expected, atol=1e-5)
    assert scores.shape == (4,)


def test_frame_reward_repeats_tensor_metadata_clip_by_clip():
    """A (B,) tensor of per-clip metadata reaches the image reward as each clip's value repeated for its frames
    (``repeat_interleave``: [a, a, a, b, b, b]), so a reward echoing it scores each clip its own value."""
    from flowrl.rewards import frame_reward

    def echo(images, prompts, value):
        return value.float()

    out = frame_reward(echo, "mean")(clips(batch=2, frames=3), ["p", "q"], value=torch.tensor([1.0, 5.0]))
    assert out.tolist() == [1.0, 5.0]


def test_frame_reward_refuses_one_prompt_per_frame():
    """Prompts count clips, not frames: 6 prompts for 2 clips of 3 frames is refused with the fix."""
    from flowrl.rewards import frame_reward

    with pytest.raises(ValueError, match="one prompt per clip"):
        frame_reward(ink, "mean")(clips(batch=2, frames=3), ["a bold 1"] * 6)


def test_frame_differences_downsample_a_frame_wider_than_size():
    """Frames area-average to size whenever either side exceeds it: a 4 x 32 frame goes to 4 x 8 before comparing."""
    x = clips(batch=1, frames=2, size=32, seed=2)[..., :4, :].double()
    pooled = torch.nn.functional.adaptive_avg_pool2d(x.reshape(2, 3, 4, 32), (4, 8)).reshape(1, 2, 3, 4, 8)
    expected = (pooled[:, 1] - pooled[:, 0]).abs().mean(dim=(1, 2, 3))
    torch.testing.assert_close(frame_differences(x, size=8).double(), expected[:, None], rtol=0, atol=1e-6)


def test_temporal_consistency_refuses_single_frames_and_bool_size():
    """One frame has no transition to score (refused, not 1.0); ``size: true`` is not the integer 1."""
    with pytest.raises(ValueError, match="F >= 2"):
        temporal_consistency()(clips(batch=2, frames=1), ["p", "q"])
    with pytest.raises(ValueError, match="positive integer"):
        temporal_consistency(size=True)
