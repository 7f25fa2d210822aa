"""Weight resolution for model rewards: hub ids from the local cache, one-line errors, no retry waits."""

import shutil
import time

import pytest
import torch
from tiny_reward_weights import IMAGE, save_clip_folder, save_clip_processor

from flowrl.rewards.pickscore import pickscore
from flowrl.rewards.weights import WeightSource, load_checkpoint, resolve_file


def _cache_repo(cache, repo_id, source_folder, commit="0" * 40):
    """Lay a folder out as huggingface_hub's cache does: refs/main -> snapshots/<commit>/files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(source_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_hub_ids_load_from_the_local_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    model = save_clip_folder(tmp_path / "src-model", seed=4)
    processor = save_clip_processor(tmp_path / "src-processor")
    cache = tmp_path / "hub"
    _cache_repo(cache, "flowrl-tests/tiny-pickscore", model)
    _cache_repo(cache, "flowrl-tests/tiny-clip-processor", processor)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    from_hub = pickscore(model="flowrl-tests/tiny-pickscore", processor="flowrl-tests/tiny-clip-processor")(
        images, ["a cat", "a dog"]
    )
    from_disk = pickscore(model=str(model), processor=str(processor))(images, ["a cat", "a dog"])
    torch.testing.assert_close(from_hub, from_disk)


def test_unreachable_hub_fails_in_one_line_without_retry_loop(monkeypatch):
    """Online mode, hub endpoint refusing connections (a closed loopback port): one attempt, one line."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        resolve_file(
            "flowrl-tests/not-there", WeightSource("HPSv2.1", "rewards.hpsv2.checkpoint"), "HPS_v2.1_compressed.pt"
        )
    assert time.perf_counter() - start < 10  # the hub client alone retries for ~25 s
    message = str(err.value)
    assert "\n" not in message and "could not be downloaded" in message
    assert (
        "hf download flowrl-tests/not-there HPS_v2.1_compressed.pt" in message
        and "rewards.hpsv2.checkpoint=" in message
    )


def test_checkpoints_unwrap_state_dict_and_data_parallel_prefix(tmp_path):
    torch.save({"state_dict": {"module.a": torch.ones(2)}, "epoch": 3}, tmp_path / "x.pt")
    assert list(load_checkpoint(tmp_path / "x.pt", nested_key="state_dict")) == ["a"]
    torch.save({"a": [1, 2]}, tmp_path / "y.pt")
    with pytest.raises(ValueError, match="flat dict of tensors"):
        load_checkpoint(tmp_path / "y.pt")


def test_a_damaged_reward_model_file_is_one_line_naming_it(tmp_path):
    """transformers raised safetensors' "Error while deserializing header" without naming the file."""
    model = save_clip_folder(tmp_path / "model", seed=4)
    processor = save_clip_processor(tmp_path / "processor")
    (weights,) = model.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:4000])
    with pytest.raises(ValueError) as err:
        pickscore(model=str(model), processor=str(processor))
    message = str(err.value)
    assert "\n" not in message and f"weight file {weights} is damaged (" in message
    assert "hf download" in message and "rewards.pickscore.model=" in message
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="bad.safetensors is damaged .*download it again"):
        load_checkpoint(tmp_path / "bad.safetensors")


def test_rewards_list_says_cached_when_default_weights_are_in_the_cache(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    from flowrl.cli import main
    from flowrl.rewards import list_rewards
    from flowrl.rewards.clipscore import CLIP_L_MODEL

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = {r.name: r for r in list_rewards()}
    assert not before["clipscore"].offline and not before["clipscore"].cached
    _cache_repo(cache, CLIP_L_MODEL, save_clip_folder(tmp_path / "src-model", seed=1))  # the default hub id, cached
    after = {r.name: r for r in list_rewards()}
    assert after["clipscore"].offline and after["clipscore"].cached
    assert not after["pickscore"].offline  # its defaults are still missing
    assert after["ink"].offline and not after["ink"].cached  # needs no weights at all
    assert main(["rewards", "list"]) == 0
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["clipscore"] == "cached" and rows["pickscore"] == "no" and rows["ink"] == "yes"
