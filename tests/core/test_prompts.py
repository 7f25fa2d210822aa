"""Prompt sets and prompt files."""

import pytest
import torch

from flowrl.models.digits.prompts import DIGITS_SETS
from flowrl.prompts.batch import collate, sample_groups
from flowrl.prompts.files import Prompt
from flowrl.prompts.sets import BUILTIN_SETS, load_prompts


def test_builtin_sets():
    styles = load_prompts("digits-styles")
    assert len(styles) == 20
    assert styles[0].text == "a bold handwritten 0" and styles[0].metadata == {"digit": 0, "style": "bold"}
    assert load_prompts("digits")[3].text == "a handwritten 3"


@pytest.mark.parametrize(
    "name, styles", [("digits-styles", ("bold", "thin")), ("digits", (None,)), ("digits-all", (None, "bold", "thin"))]
)
def test_builtin_digit_sets_are_exact(name, styles):
    # the texts the embedded model was pretrained on, as they were hard-coded here: style-major, digits 0..9
    texts = [f"a {s + ' ' if s else ''}handwritten {d}" for s in styles for d in range(10)]
    expected = [(text, {"digit": i % 10, "style": styles[i // 10]}) for i, text in enumerate(texts)]
    prompts = load_prompts(name)
    assert [(p.text, p.metadata) for p in prompts] == expected
    assert all(isinstance(p, Prompt) for p in prompts)
    assert load_prompts(name)[0].metadata is not prompts[0].metadata  # a fresh list each call: callers may edit it


def test_builtin_sets_come_from_the_digits_package():
    assert list(BUILTIN_SETS) == ["digits-styles", "digits", "digits-all"]
    assert all(BUILTIN_SETS[name] is DIGITS_SETS[name] for name in DIGITS_SETS)


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
