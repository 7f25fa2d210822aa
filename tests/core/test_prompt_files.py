"""Prompt files as the reference prompt sets ship them: GenEval, OCR, PickScore, HPDv2, CSV."""

from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError, load_config
from flowrl.prompts.batch import sample_groups
from flowrl.prompts.files import Prompt
from flowrl.prompts.sets import holdout_split, load_prompts

DATA = Path(__file__).resolve().parents[1] / "data" / "prompts"


def test_geneval_folder_splits_and_metadata():
    train = load_prompts(str(DATA / "geneval"), split="train")
    test = load_prompts(str(DATA / "geneval"), split="test")
    assert len(train) == 5 and len(test) == 2
    counting = train[2]
    assert counting.text == "a photo of three apples"
    assert counting.metadata == {
        "tag": "counting",
        "include": [{"class": "apple", "count": 3}],
        "exclude": [{"class": "apple", "count": 4}],
    }
    assert test[0].metadata["include"][1] == {"class": "kite", "count": 1, "color": "blue"}


def test_ocr_quoted_text_becomes_metadata():
    train = load_prompts(str(DATA / "ocr"))
    assert [p.metadata["ocr_text"] for p in train] == ["OPEN 24 HOURS", "Monday Again", "Daily Specials"]
    assert load_prompts(str(DATA / "ocr"), split="test")[1].metadata == {"ocr_text": "Happy 30th Anna"}
    plain = load_prompts(str(DATA / "pickscore" / "train.txt"))
    assert all(p.metadata == {} for p in plain) and len(plain) == 3


def test_hpdv2_json_lists_and_csv():
    anime = load_prompts(str(DATA / "hpdv2" / "anime.json"))
    assert len(anime) == 3 and anime[2].text == "a cat wizard reading a spellbook by candlelight"
    photo = load_prompts(str(DATA / "hpdv2" / "photo.json"))
    assert photo[0].metadata == {"style": "photo"}
    rows = load_prompts(str(DATA / "prompts.csv"))
    assert rows[0].text == "a red apple on a wooden table, still life"
    assert rows[1].metadata == {"category": "vehicle", "target": "bicycle"}


def test_metadata_reaches_reward_keywords_in_groups():
    prompts = load_prompts(str(DATA / "geneval"))
    batch = sample_groups(prompts, 5, 3, torch.Generator().manual_seed(0))
    assert len(batch.texts) == 15 and batch.group_ids.tolist() == [g for g in range(5) for _ in range(3)]
    for i, text in enumerate(batch.texts):
        source = next(p for p in prompts if p.text == text)
        assert batch.metadata["tag"][i] == source.metadata["tag"]
        assert batch.metadata["include"][i] == source.metadata["include"]
    assert set(batch.metadata) == {"tag", "include", "exclude"}
    assert sum(e is not None for e in batch.metadata["exclude"]) == 3  # only the counting prompt has one


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("p.csv", "prompt,tag\na cat,x\na dog,y,extra\n", r"p.csv line 3: has 3 fields but the header has 2"),
        ("q.csv", "text,tag\na cat,x\n", r"q.csv line 1: the header row must name a 'prompt' column"),
        ("r.csv", "prompt,tag\n,x\n", r"r.csv line 2: the 'prompt' field is empty"),
        ("l.json", '[\n "a cat",\n {"caption": "x"}\n]', r"l.json item 1: needs a non-empty string field"),
        ("b.json", '[\n "a cat",\n oops\n]', r"b.json line 3: invalid JSON"),
        ("s.jsonl", '{"prompt": "ok"}\n"just a string"\n', r"s.jsonl line 2: needs a non-empty string field"),
        ("n.txt", "ok\nbad\x00line\n", r"n.txt line 2: contains a NUL byte"),
        ("p.yaml", "a", r"must end in .txt, .jsonl, .csv or .json"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        load_prompts(str(path))


def test_folder_without_split_file(tmp_path):
    (tmp_path / "train.txt").write_text("a cat\n")
    assert load_prompts(str(tmp_path))[0].text == "a cat"
    with pytest.raises(FileNotFoundError, match="has no test file"):
        load_prompts(str(tmp_path), split="test")


def test_holdout_split_is_disjoint_and_deterministic():
    prompts = [p for f in ("anime.json", "photo.json") for p in load_prompts(str(DATA / "hpdv2" / f))]
    prompts += load_prompts(str(DATA / "pickscore" / "train.txt")) + load_prompts(str(DATA / "ocr"))
    train, test = holdout_split(prompts, 0.3, "train"), holdout_split(prompts, 0.3, "test")
    assert {p.text for p in train}.isdisjoint({p.text for p in test})
    assert len(train) + len(test) == len(prompts) and test
    assert [p.text for p in holdout_split(prompts, 0.3, "test")] == [p.text for p in test]
    with pytest.raises(ValueError, match="test_fraction must be in"):
        holdout_split(prompts, 1.0, "train")


def test_run_prompts_from_a_folder_or_a_held_out_fraction():
    from flowrl.config import load_config
    from flowrl.recipe import load_run_prompts

    folder = str(DATA / "ocr")
    train, test = load_run_prompts(load_config(None, [f"prompts.train={folder}", f"prompts.eval={folder}"]))
    assert len(train) == 3 and len(test) == 2 and test[0].metadata == {"ocr_text": "SLOW DOWN"}
    cfg = load_config(None, [f"prompts.train={DATA / 'geneval' / 'train_metadata.jsonl'}", "prompts.test_fraction=0.5"])
    train, test = load_run_prompts(cfg)
    assert len(train) + len(test) == 5 and {p.text for p in train}.isdisjoint({p.text for p in test})


def test_an_eval_set_given_beside_test_fraction_is_refused_not_ignored():
    """test_fraction takes the eval prompts from prompts.train: a prompts.eval of one's own would be dropped."""
    train = f"prompts.train={DATA / 'geneval' / 'train_metadata.jsonl'}"
    with pytest.raises(ConfigError, match="prompts.eval='.*ocr' would be ignored; set one of the two"):
        load_config(None, [train, f"prompts.eval={DATA / 'ocr'}", "prompts.test_fraction=0.5"])


@pytest.mark.parametrize(
    "name, content",
    [("p.txt", "a bold 3\n"), ("p.jsonl", '{"prompt": "a bold 3"}\n'), ("p.csv", "prompt,x\na bold 3,1\n")],
)
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, name, content):
    """Windows editors start UTF-8 files with a BOM: it must not reach the tokenizer or the CSV header."""
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + content.encode())
    assert [p.text for p in load_prompts(str(path), split="test")] == ["a bold 3"]


def test_sample_groups_use_every_prompt_before_repeating_one() -> None:
    """More prompts per iteration than the set holds: each prompt once, then a fresh draw tops up to exactly N."""
    prompts = load_prompts("digits")[:3]
    batch = sample_groups(prompts, 5, 2, torch.Generator().manual_seed(0))
    assert len(batch.texts) == 10 and batch.group_ids.tolist() == [g for g in range(5) for _ in range(2)]
    firsts = batch.texts[::2]
    assert sorted(firsts[:3]) == sorted(p.text for p in prompts)  # without replacement while possible
    assert len(set(firsts[3:])) == 2  # the top-up is a second permutation's head


def test_csv_blank_cells_rows_are_skipped_and_unnamed_columns_dropped(tmp_path: Path) -> None:
    """A row of blank cells is skipped like an empty line; a column without a header name is not metadata."""
    path = tmp_path / "p.csv"
    path.write_text("prompt,style,\na cat,bold,\n , ,\na dog,thin,x\n")
    prompts = load_prompts(str(path))
    assert [(p.text, p.metadata) for p in prompts] == [("a cat", {"style": "bold"}), ("a dog", {"style": "thin"})]


def test_csv_row_with_too_few_fields_names_the_line(tmp_path: Path) -> None:
    """A short row is refused with its line number, not read with its columns shifted."""
    path = tmp_path / "short.csv"
    path.write_text("prompt,tag\na cat,x\na dog\n")
    with pytest.raises(ValueError, match=r"short.csv line 3: has 1 fields but the header has 2"):
        load_prompts(str(path))


def test_json_object_with_a_prompts_list_and_padded_prompts(tmp_path: Path) -> None:
    """``{"prompts": [...]}`` loads like a bare list, and object prompts are stripped like string ones."""
    path = tmp_path / "p.json"
    path.write_text('{"prompts": ["  a cat ", {"prompt": "  a dog  ", "style": "x"}]}')
    assert [(p.text, p.metadata) for p in load_prompts(str(path))] == [("a cat", {}), ("a dog", {"style": "x"})]


def test_upper_case_suffix_and_eval_split_name(tmp_path: Path) -> None:
    """A ``.TXT`` file reads by its lower-cased suffix; a folder's ``eval.*`` file is its test split."""
    (tmp_path / "train.txt").write_text("a cat\n")
    (tmp_path / "eval.txt").write_text("a dog\n")
    assert [p.text for p in load_prompts(str(tmp_path), split="test")] == ["a dog"]
    upper = tmp_path / "P.TXT"
    upper.write_text("a bird\n")
    assert [p.text for p in load_prompts(str(upper))] == ["a bird"]


def test_an_unknown_split_name_is_refused(tmp_path: Path) -> None:
    """A split other than train/test is a ValueError naming the choices, not a KeyError."""
    from flowrl.prompts.files import split_file

    (tmp_path / "train.txt").write_text("a cat\n")
    with pytest.raises(ValueError, match="prompt split must be 'train' or 'test'; got 'dev'"):
        split_file(tmp_path, "dev")


def test_holdout_test_part_is_the_prompts_hashing_below_the_fraction() -> None:
    """The test part holds the prompts whose sha256 maps below test_fraction, so it grows with the fraction."""
    import hashlib

    prompts = load_prompts("digits-all")

    def unit(p: Prompt) -> float:
        return int(hashlib.sha256(p.text.encode("utf-8")).hexdigest()[:12], 16) / 16**12

    small, large = holdout_split(prompts, 0.2, "test"), holdout_split(prompts, 0.8, "test")
    assert [p.text for p in small] == [p.text for p in prompts if unit(p) < 0.2]
    assert {p.text for p in small} < {p.text for p in large}
    assert [p.text for p in holdout_split(prompts, 0.2, "train")] == [p.text for p in prompts if unit(p) >= 0.2]
