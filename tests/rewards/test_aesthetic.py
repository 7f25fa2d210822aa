"""LAION aesthetic predictor: the published .pth head (layers.N.*) on normalised CLIP image embeddings."""

import pytest
import torch
from safetensors.torch import save_file
from tiny_reward_weights import (
    IMAGE,
    laion_mlp,
    save_aesthetic_head,
    save_clip_folder,
    save_clip_processor,
    tiny_clip_model,
)

from flowrl.rewards.aesthetic import AESTHETIC_HEAD_FILE, aesthetic
from flowrl.rewards.image_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return str(save_clip_processor(save_clip_folder(tmp_path_factory.mktemp("aesthetic") / "clip", seed=3)))


def _by_hand(images, head_state):
    """Unit image embedding from transformers' CLIPModel, then the linear layers applied by hand."""
    model = tiny_clip_model(seed=3)
    with torch.no_grad():
        emb = model.get_image_features(pixel_values=normalize(images, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)).pooler_output
    x = emb / emb.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):
        x = x @ head_state[f"layers.{i}.weight"].T + head_state[f"layers.{i}.bias"]
    return x[:, 0]


def test_published_pth_head(tmp_path, clip):
    head = save_aesthetic_head(tmp_path / AESTHETIC_HEAD_FILE, seed=1)
    images = torch.rand(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    scores = aesthetic(head=str(head), model=clip)(images, ["", "", ""])
    torch.testing.assert_close(scores, _by_hand(images, laion_mlp(seed=1).state_dict()), rtol=1e-5, atol=1e-6)


def test_folder_and_safetensors_heads(tmp_path, clip):
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    folder_head = save_aesthetic_head(tmp_path / "dir" / AESTHETIC_HEAD_FILE, seed=2).parent
    state = laion_mlp(seed=2).state_dict()
    expected = _by_hand(images, state)
    torch.testing.assert_close(
        aesthetic(head=str(folder_head), model=clip)(images, ["a", "b"]), expected, rtol=1e-5, atol=1e-6
    )
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "head.safetensors")
    torch.testing.assert_close(
        aesthetic(head=str(tmp_path / "head.safetensors"), model=clip)(images, ["a", "b"]),
        expected,
        rtol=1e-5,
        atol=1e-6,
    )


def test_single_linear_head(tmp_path, clip):
    torch.manual_seed(4)
    linear = torch.nn.Linear(12, 1)
    torch.save(linear.state_dict(), tmp_path / "linear.pth")
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2))
    model = tiny_clip_model(seed=3)
    with torch.no_grad():
        emb = model.get_image_features(pixel_values=normalize(images, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)).pooler_output
        expected = linear(emb / emb.norm(dim=-1, keepdim=True))[:, 0]
    torch.testing.assert_close(
        aesthetic(head=str(tmp_path / "linear.pth"), model=clip)(images, ["", ""]), expected, rtol=1e-5, atol=1e-6
    )


def test_head_errors(tmp_path, clip):
    with pytest.raises(FileNotFoundError, match=r"improved-aesthetic-predictor.*rewards\.aesthetic\.head"):
        aesthetic(model=clip)
    with pytest.raises(FileNotFoundError, match="rewards.aesthetic.head"):
        aesthetic(head=str(tmp_path / "missing.pth"), model=clip)
    with pytest.raises(ValueError, match="768|12-d"):
        aesthetic(head=str(save_aesthetic_head(tmp_path / "wide.pth", in_features=20)), model=clip)
    torch.save({"layers.0.weight": torch.zeros(1, 12), "extra": torch.zeros(1)}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match="unexpected key 'extra'"):
        aesthetic(head=str(tmp_path / "odd.pth"), model=clip)


def test_unsafe_pickle_is_refused(tmp_path, clip):
    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"layers.0.weight": Payload()}, tmp_path / "evil.pth")
    refused = r"\(UnpicklingError: Unsupported global: GLOBAL print was not an allowed global by default\.\); "
    with pytest.raises(ValueError, match=r"weights_only=True\) " + refused):
        aesthetic(head=str(tmp_path / "evil.pth"), model=clip)  # what torch refused, not its paragraph of advice
