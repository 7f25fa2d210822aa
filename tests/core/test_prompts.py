"""Prompt sets and prompt files."""

import torch
import pytest

from flowrl.prompts.batch import collate, sample_groups
from flowrl.prompts.sets import load_prompts


def test_builtin_sets():
    styles = load_prompts("digits-styles")
    assert len(styles) == 20
    assert styles[0].text == "a bold handwritten 0" and styles[0].metadata == {"digit": 0, "style": "bold"}
    assert load_prompts("digits")[3].text == "a handwritten 3"


def test_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n a dog \n")
    assert [p.text for p in load_prompts(str(txt))] == ["a cat", "a dog"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a red cube", "objects": ["cube"]}\n')
    (p,) = load_prompts(str(jsonl))
    assert p.metadata == {"objects": ["cube"]}


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": 3}\n', "bad.jsonl line 2: needs a non-empty string field"),
        ("bad2.jsonl", '{"prompt": "ok"}\n\n{oops}\n', "bad2.jsonl line 3: invalid JSON"),
        ("empty.txt", "\n\n", "holds no prompts"),
        ("p.tsv", "a", "must end in .txt, .jsonl, .csv or .json"),
    ],
)
def test_malformed_files(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        load_prompts(str(path))


def test_not_utf8(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompts(str(path))


def test_unknown_set():
    with pytest.raises(ValueError, match="neither a built-in set"):
        load_prompts("nope")


def test_groups_and_metadata():
    prompts = load_prompts("digits-styles")
    batch = sample_groups(prompts, 3, 4, torch.Generator().manual_seed(0))
    assert len(batch.texts) == 12
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert len(set(batch.texts[:4])) == 1
    assert len(batch.metadata["digit"]) == 12
    assert collate(prompts[:2]).metadata["style"] == ["bold", "bold"]
