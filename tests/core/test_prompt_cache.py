"""Prompt-embedding cache: hit path, disk persistence, model fingerprint."""

from pathlib import Path

import torch
from conftest import tiny_sd3_pipeline

from flowrl.models.sd3 import SD3Adapter
from flowrl.prompts.cache import PromptCache, model_fingerprint


def test_hits_and_equality(tiny_sd3):
    cache = PromptCache(tiny_sd3)
    prompts = ["a bold handwritten 1", "a thin handwritten 2", "a bold handwritten 1"]
    cond = cache.encode(prompts)
    assert cache.misses == 2 and cache.hits == 1
    direct = tiny_sd3.encode_prompt(prompts)
    for key in direct:
        torch.testing.assert_close(cond[key], direct[key], rtol=1e-5, atol=1e-6)
    again = cache.encode(prompts[:2])
    assert cache.misses == 2 and cache.hits == 3
    torch.testing.assert_close(again["pooled_projections"], cond["pooled_projections"][:2], rtol=0, atol=0)


def test_disk_cache_is_reused_by_a_new_instance(tiny_sd3, tmp_path):
    first = PromptCache(tiny_sd3, tmp_path)
    cond = first.encode(["a handwritten 7"])
    files = list((tmp_path / first.fingerprint).glob("*.safetensors"))
    assert len(files) == 1
    second = PromptCache(tiny_sd3, tmp_path)
    reused = second.encode(["a handwritten 7"])
    assert second.misses == 0 and second.hits == 1
    torch.testing.assert_close(reused["encoder_hidden_states"], cond["encoder_hidden_states"], rtol=0, atol=0)


def test_a_damaged_cache_file_is_a_miss_that_is_encoded_again_and_rewritten(tiny_sd3, tmp_path, capsys):
    first = PromptCache(tiny_sd3, tmp_path)
    cond = first.encode(["a handwritten 7"])
    (path,) = (tmp_path / first.fingerprint).glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:50])
    second = PromptCache(tiny_sd3, tmp_path)
    again = second.encode(["a handwritten 7"])
    assert second.misses == 1 and second.hits == 0
    assert f"flowrl: warning: prompt cache file {path} is damaged (" in capsys.readouterr().err
    torch.testing.assert_close(again["encoder_hidden_states"], cond["encoder_hidden_states"], rtol=0, atol=0)
    third = PromptCache(tiny_sd3, tmp_path)  # the file was rewritten whole
    third.encode(["a handwritten 7"])
    assert third.hits == 1 and "warning" not in capsys.readouterr().err


def test_other_weights_give_another_fingerprint(tiny_sd3):
    other = SD3Adapter(tiny_sd3_pipeline(seed=1), max_sequence_length=2, resolution=(8, 8))
    assert model_fingerprint(tiny_sd3) != model_fingerprint(other)
    assert model_fingerprint(tiny_sd3) == model_fingerprint(SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2))


def test_fingerprint_covers_the_tokenizer(tiny_sd3):
    before = model_fingerprint(tiny_sd3)
    tiny_sd3.pipe.tokenizer.add_tokens(["zebra"])  # same encoders, another vocabulary
    assert model_fingerprint(tiny_sd3) != before


def test_two_writers_of_one_prompt_both_succeed(tiny_sd3, tmp_path, monkeypatch):
    """Ranks sharing prompts.cache_dir store the same prompt at once: neither may lose its temporary file."""
    import flowrl.prompts.cache as cache_module

    rank0, rank1 = PromptCache(tiny_sd3, tmp_path), PromptCache(tiny_sd3, tmp_path)
    real_save, nested = cache_module.save_file, []

    def save_while_the_other_rank_saves(tensors, path):
        real_save(tensors, path)
        if not nested:  # the other rank writes and renames the same prompt between this write and its rename
            nested.append(True)
            rank1.encode(["a handwritten 4"])

    monkeypatch.setattr(cache_module, "save_file", save_while_the_other_rank_saves)
    cond = rank0.encode(["a handwritten 4"])
    folder = tmp_path / rank0.fingerprint
    assert [p.suffix for p in folder.iterdir()] == [".safetensors"]  # one whole file, no temporary left
    reread = PromptCache(tiny_sd3, tmp_path).encode(["a handwritten 4"])
    torch.testing.assert_close(reread["encoder_hidden_states"], cond["encoder_hidden_states"], rtol=0, atol=0)


def test_fingerprint_covers_every_text_encoder_and_the_sequence_length(tiny_sd3: SD3Adapter) -> None:
    """The second text encoder's weights and max_sequence_length both change the fingerprint."""
    before = model_fingerprint(tiny_sd3)
    longer = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=3, resolution=(8, 8))
    assert model_fingerprint(longer) != before
    with torch.no_grad():
        next(tiny_sd3.pipe.text_encoder_2.parameters()).add_(1.0)
    assert model_fingerprint(tiny_sd3) != before


def test_warm_returns_the_encoded_count_and_contains_sees_the_disk(tiny_sd3: SD3Adapter, tmp_path: Path) -> None:
    """warm() returns how many distinct prompts it encoded this call; ``in`` finds a prompt another run wrote."""
    cache = PromptCache(tiny_sd3, tmp_path)
    assert cache.warm(["a handwritten 1", "a handwritten 2", "a handwritten 1"]) == 2
    assert cache.warm(["a handwritten 1", "a handwritten 3"]) == 1
    fresh = PromptCache(tiny_sd3, tmp_path)
    assert "a handwritten 3" in fresh and "a handwritten 4" not in fresh
    assert fresh.hits == 0 and fresh.misses == 0 and not fresh.memory  # a membership test loads nothing
