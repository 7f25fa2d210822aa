"""Checkpoints that are checked: manifest, named corruptions, fallback, config fingerprint, pruning, full disk.

docs/reliability.md lists these cases and their messages.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from flowrl import checkpoint as ck
from flowrl.checkpoint import load_checkpoint, save_checkpoint
from flowrl.cli import main
from flowrl.config import ConfigError, load_config, to_dict
from flowrl.outputs import DiskFullError, MetricsLogger
from flowrl.resume import check_resume_config, latest_good_checkpoint, prune_checkpoints

FILES = ["lora.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json", "adapter-ema.safetensors"]
SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=2",
    "train.iterations=3",
    "train.save_every=1",
    "train.eval_every=1",
    "train.eval_seeds=1",
    "train.threads=1",
    "train.progress=false",
    "output.grid_seeds=1",
]


def _state(iteration: int = 7, lora_dtype: torch.dtype = torch.float32) -> dict:
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(3, 2)
    opt.step()
    gen = torch.Generator().manual_seed(5)
    return {
        "lora": {"a.lora_A.weight": torch.randn(2, 2).to(lora_dtype)},
        "adapters": {"ema": {"a.lora_A.weight": torch.randn(2, 2)}},
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "iteration": iteration,
        "samples_seen": 10 * iteration,
        "config": to_dict(load_config()),
    }


def _one_line_error(folder: Path, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message
    for fragment in (str(folder), *fragments):
        assert fragment in message, message
    return message


@pytest.fixture
def saved(tmp_path) -> Path:
    return save_checkpoint(_state(), tmp_path / "run" / "checkpoints" / "iter-000007")


def test_manifest_lists_every_file_and_round_trips(tmp_path):
    state = _state()
    saved = save_checkpoint(state, tmp_path / "ck")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["version"] == 1 and sorted(manifest["files"]) == sorted(FILES)
    for name, entry in manifest["files"].items():
        assert entry["size"] == (saved / name).stat().st_size and len(entry["sha256"]) == 64
    back = load_checkpoint(saved)
    assert back["iteration"] == 7 and back["config"] == json.loads(json.dumps(to_dict(load_config())))
    assert torch.equal(back["adapters"]["ema"]["a.lora_A.weight"], state["adapters"]["ema"]["a.lora_A.weight"])


@pytest.mark.parametrize("name", FILES + ["manifest.json"])
def test_flipped_byte_is_named(saved, name):
    path = saved / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _one_line_error(saved, name)


@pytest.mark.parametrize("name", FILES + ["manifest.json"])
def test_truncated_file_is_named(saved, name):
    path = saved / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _one_line_error(saved, name)


@pytest.mark.parametrize("name", FILES + ["manifest.json"])
def test_deleted_file_is_named(saved, name):
    (saved / name).unlink()
    message = _one_line_error(saved, name, "missing")
    if name == "manifest.json":
        assert "not a finished checkpoint" in message


def test_unlisted_file_is_named(saved):
    shutil.copy(saved / "lora.safetensors", saved / "adapter-old.safetensors")
    _one_line_error(saved, "adapter-old.safetensors", "not listed")


def test_edited_iteration_fails_the_checksum(saved):
    text = (saved / "trainer.json").read_text()
    assert '"iteration": 7,' in text
    (saved / "trainer.json").write_text(text.replace('"iteration": 7,', '"iteration": 9,'))  # same size
    _one_line_error(saved, "trainer.json", "fails its checksum")


def test_float16_lora_is_named(tmp_path):
    folder = save_checkpoint(_state(lora_dtype=torch.float16), tmp_path / "ck")
    _one_line_error(folder, "lora.safetensors", "float16", "float32")


def test_missing_optimizer_key_is_named(tmp_path):
    state = _state()
    del state["optimizer"]["state"][0]["exp_avg"]
    _one_line_error(save_checkpoint(state, tmp_path / "ck"), "optimizer.safetensors", "'exp_avg'")


def test_missing_adam_step_is_named(tmp_path):
    """Every AdamW key is required per parameter, the step count included."""
    state = _state()
    del state["optimizer"]["state"][0]["step"]
    _one_line_error(save_checkpoint(state, tmp_path / "ck"), "optimizer.safetensors has no 'step' for parameter 0")


def test_negative_counter_is_named(tmp_path):
    _one_line_error(save_checkpoint(_state(iteration=-1), tmp_path / "ck"), "trainer.json", "'iteration'")


@pytest.mark.parametrize(
    "edit, fragment",
    [
        ({"generator": torch.zeros(10, dtype=torch.uint8)}, "'generator' has shape (10,); a CPU generator's is"),
        ({"torch_rng": torch.zeros(10, dtype=torch.uint8)}, "'torch_rng' has shape (10,)"),
        ({"guard": [1, 2]}, "trainer.json 'guard' must be a mapping (got list)"),
        ({"heldout": 3}, "trainer.json 'heldout' must be a mapping (got int)"),
        ({"config": [1]}, "trainer.json 'config' must be a mapping (got list)"),
        ({"nfe": "x"}, "trainer.json 'nfe' must be a non-negative integer"),
        ({"iteration": True}, "trainer.json 'iteration' must be a non-negative integer (got True)"),
        ({"samples_seen": -1}, "trainer.json 'samples_seen' must be a non-negative integer (got -1)"),
        ({"generator": torch.Generator().get_state().to(torch.int16)}, "rng.safetensors has no uint8 'generator'"),
        (
            {"adapters": {"ema": {"a.lora_A.weight": torch.zeros(2, 2, dtype=torch.int64)}}},
            "adapter-ema.safetensors holds int64 tensor 'a.lora_A.weight' (training keeps LoRA weights in floating",
        ),
        (
            {"lora": {"a.lora_A.weight": torch.zeros(2, 2), "b.lora_B.weight": torch.tensor([0.0, float("nan")])}},
            "lora.safetensors: tensor 'b.lora_B.weight' holds NaN or inf (corrupt or edited)",
        ),
        (
            {"adapters": {"ema": {"a.lora_A.weight": torch.full((2, 2), float("inf"), dtype=torch.bfloat16)}}},
            "adapter-ema.safetensors: tensor 'a.lora_A.weight' holds NaN or inf",
        ),
        ({"iteration": 9}, "trainer.json 'iteration' is 9 but the folder is iter-000007 (edited or moved)"),
    ],
)
def test_a_signed_but_inconsistent_state_is_named(tmp_path, edit, fragment):
    """A checkpoint whose manifest was recomputed after an edit (checksums pass) is still checked after parsing."""
    folder = save_checkpoint({**_state(), **edit}, tmp_path / "iter-000007")
    _one_line_error(folder, fragment)


def _set(group: dict, key: str, value) -> None:
    group[key] = value


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda o: _set(o["param_groups"][0], "lr", -5.0), "param group 0: 'lr' must be a number in (0, 1] (got -5.0)"),
        (
            lambda o: _set(o["param_groups"][0], "lr", "abc"),
            "group 0: 'lr' must be a number in (0, 1] (got 'abc')",
        ),
        (lambda o: _set(o["param_groups"][0], "lr", float("nan")), "'lr' must be a number in (0, 1] (got nan)"),
        (lambda o: _set(o["param_groups"][0], "lr", True), "'lr' must be a number in (0, 1] (got True)"),
        (lambda o: _set(o["param_groups"][0], "eps", 0.0), "'eps' must be a number in (0, 1] (got 0.0)"),
        (lambda o: _set(o["param_groups"][0], "weight_decay", -1), "'weight_decay' must be a number in [0, 1]"),
        (lambda o: _set(o["param_groups"][0], "betas", "ab"), "'betas' must be two numbers in [0, 1) (got 'ab')"),
        (lambda o: _set(o["param_groups"][0], "betas", 5), "'betas' must be two numbers in [0, 1) (got 5)"),
        (lambda o: _set(o["param_groups"][0], "betas", (0.9, 1.0)), "'betas' must be two numbers in [0, 1)"),
        (lambda o: _set(o["param_groups"][0], "amsgrad", "no"), "'amsgrad' must be true or false (got 'no')"),
        (lambda o: _set(o["param_groups"][0], "params", "0"), "'params' must be a list of parameter indices"),
        (lambda o: _set(o, "param_groups", [1]), "trainer.json optimizer param group 0: must be a mapping (got int)"),
    ],
)
def test_an_optimizer_param_group_torch_would_misuse_is_named(tmp_path, edit, fragment):
    """AdamW takes any param group torch is given (a negative lr trains backwards; text lr fails mid-step naming
    nothing): each value is checked, and the message names trainer.json, the group and the key."""
    state = _state()
    edit(state["optimizer"])
    message = _one_line_error(save_checkpoint(state, tmp_path / "ck"), "trainer.json optimizer ", fragment)
    assert "optimizer.safetensors" not in message


def test_optimizer_scalars_that_are_not_a_mapping_blame_trainer_json(tmp_path):
    folder = save_checkpoint(_state(), tmp_path / "ck")
    meta = json.loads((folder / "trainer.json").read_text())
    meta["optimizer"]["scalars"] = [1, 2]
    (folder / "trainer.json").write_text(json.dumps(meta))
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"}
    (folder / "manifest.json").write_bytes(ck._manifest(files))  # signed as save_checkpoint signs
    _one_line_error(folder, "trainer.json optimizer 'scalars' must be a mapping (got list)")


@pytest.mark.parametrize(
    "value, fragment",
    [
        (float("nan"), "'state.0.exp_avg_sq' holds NaN or inf"),
        (-1.0, "'state.0.exp_avg_sq' holds negative values"),
    ],
)
def test_optimizer_moments_that_adam_cannot_hold_are_named(tmp_path, value, fragment):
    """A NaN moment or a negative second moment (a square root of it is taken) is refused, naming the tensor."""
    state = _state()
    state["optimizer"]["state"][0]["exp_avg_sq"] = torch.full((3, 2), value)
    _one_line_error(save_checkpoint(state, tmp_path / "ck"), "optimizer.safetensors: tensor " + fragment)


def test_resume_from_one_checkpoint_refuses_a_bad_metrics_row_before_loading(tmp_path):
    """``--resume RUN/checkpoints/iter-N`` rewrites RUN's metrics.jsonl: a bad row in the middle is refused first."""
    from flowrl.resume import find_resume

    run = _run_with(tmp_path, 2)
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "a\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON .*; repair or remove that line"):
        find_resume(run / "checkpoints" / "iter-000002")


def _resign(folder: Path, edit) -> None:
    """Edit the manifest's body and recompute its own checksum, as a tool that rewrites checkpoints would."""
    body = {k: v for k, v in json.loads((folder / "manifest.json").read_text()).items() if k != "sha256"}
    edit(body)
    (folder / "manifest.json").write_text(json.dumps({**body, "sha256": ck._digest(body)}))


def test_a_re_signed_manifest_is_still_checked(saved):
    """A manifest that passes its own checksum must still be of this format version, list every required file,
    and account for every ``.json`` file in the folder (not only ``.safetensors``).
    """
    extra = saved.parent / "extra"
    shutil.copytree(saved, extra)
    odd = shutil.copytree(saved, saved.parent / "odd")
    (extra / "notes.json").write_text("{}")
    _one_line_error(extra, "notes.json is not listed in manifest.json")
    _resign(saved, lambda body: body.update(version=2))
    _one_line_error(saved, "manifest.json has format version 2; this flowrl reads 1")
    _resign(saved, lambda body: (body.update(version=1), body["files"].pop("rng.safetensors")))
    (saved / "rng.safetensors").unlink()
    _one_line_error(saved, "manifest.json does not list rng.safetensors")
    _resign(odd, lambda body: body["files"].update({"sub/lora.safetensors": body["files"]["lora.safetensors"]}))
    _one_line_error(odd, "manifest.json lists 'sub/lora.safetensors', which is not a file of the folder")
    _resign(odd, lambda body: body["files"].update({"lora.safetensors": 5}))
    _one_line_error(odd, "manifest.json has no valid file list")


def test_a_bf16_extra_adapter_and_a_null_config_load(tmp_path):
    """Extra adapters (``adapter-*.safetensors``) may follow the model's dtype: a bf16 one loads as saved; and a
    ``trainer.json`` with ``"config": null`` (a checkpoint written without the resolved config) loads with config None.
    """
    ema = {"a.lora_A.weight": torch.randn(2, 2).to(torch.bfloat16)}
    folder = save_checkpoint({**_state(), "adapters": {"ema": ema}}, tmp_path / "ck")
    back = load_checkpoint(folder)["adapters"]["ema"]["a.lora_A.weight"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, ema["a.lora_A.weight"])
    meta = json.loads((folder / "trainer.json").read_text())
    (folder / "trainer.json").write_text(json.dumps({**meta, "config": None}))
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"}
    (folder / "manifest.json").write_bytes(ck._manifest(files))  # signed as save_checkpoint signs
    loaded = load_checkpoint(folder)
    assert loaded["config"] is None and loaded["iteration"] == 7


def test_stale_partial_is_cleaned_and_failed_save_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "iter-000001"
    (tmp_path / "iter-000001.partial").mkdir()
    (tmp_path / "iter-000001.partial" / "trainer.json.tmp").write_text("{")
    save_checkpoint(_state(1), target)
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES + ["manifest.json"])
    assert not (tmp_path / "iter-000001.partial").exists()

    def broken(path, data):
        raise RuntimeError("killed")

    monkeypatch.setattr(ck, "_write_bytes", broken)
    with pytest.raises(RuntimeError):
        save_checkpoint(_state(2), tmp_path / "iter-000002")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000001"]


def test_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = save_checkpoint(_state(1), tmp_path / "iter-000001")
    real = ck._write_bytes

    def full(path, data):
        if path.name == "optimizer.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ck, "_write_bytes", full)
    with pytest.raises(DiskFullError) as info:
        save_checkpoint(_state(2), tmp_path / "iter-000002")
    message = str(info.value)
    assert "\n" not in message
    for fragment in ("iter-000002", "optimizer.safetensors", "no space left", "to write", "free"):
        assert fragment in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000001"]
    assert load_checkpoint(first)["iteration"] == 1


def test_full_disk_on_metrics_names_the_file(tmp_path, monkeypatch):
    import flowrl.outputs as outputs

    def full(path, line):
        raise OSError(errno.ENOSPC, "No space left on device")

    logger = MetricsLogger(tmp_path)
    monkeypatch.setattr(outputs, "_append_line", full)
    with pytest.raises(DiskFullError, match=r"metrics\.jsonl \(step 3\): no space left on device \(\d+ B to write"):
        logger.log(3, {"reward_mean": 1.0})
    logger.close()


def _run_with(tmp_path, count: int) -> Path:
    for it in range(1, count + 1):
        save_checkpoint(_state(it), tmp_path / "checkpoints" / f"iter-{it:06d}")
    return tmp_path


def test_latest_good_checkpoint_falls_back_with_a_warning(tmp_path):
    run = _run_with(tmp_path, 3)
    (run / "checkpoints" / "iter-000003" / "rng.safetensors").write_bytes(b"junk")
    (run / "checkpoints" / "iter-000004.partial").mkdir()  # an interrupted save is not a candidate
    found = latest_good_checkpoint(run)
    assert found.path.name == "iter-000002" and found.state["iteration"] == 2
    (warning,) = found.warnings
    assert "iter-000003" in warning and "rng.safetensors" in warning and "\n" not in warning


def test_a_launch_warns_of_a_skipped_checkpoint_once(tmp_path, capsys):
    """Every rank of a launch finds the same checkpoint; only rank 0 prints the fallback warning."""
    from flowrl.recipe import Run

    run = _run_with(tmp_path, 2)
    (run / "checkpoints" / "iter-000002" / "rng.safetensors").write_bytes(b"junk")
    for rank, lines in ((0, 1), (1, 0)):
        process = Run.__new__(Run)  # the part of a Run that finds its checkpoint
        process.cfg, process.is_main = load_config(), rank == 0
        process.device_given = process.cfg.model.device
        assert process._find_resume(str(run)).path.name == "iter-000001"
        assert capsys.readouterr().err.count("flowrl: warning: checkpoint") == lines


def test_a_multi_gpu_run_records_the_device_it_was_given():
    """Each rank of a GPU launch trains on cuda:RANK; rank 0's record must still resume on rank 1 and in --processes."""
    from flowrl.recipe import Run

    def rank(r: int) -> Run:
        process = Run.__new__(Run)  # the part of Run.__init__ that places the rank (flowrl/recipe.py)
        cfg = load_config(None, ["model.device=cuda"])
        process.cfg, process.device_given, process.is_main = cfg, cfg.model.device, r == 0
        cfg.model.device = f"cuda:{r}"  # the rank's accelerator.device
        return process

    saved = rank(0).config_dict()  # config.yaml and every checkpoint's config
    assert saved["model"]["device"] == "cuda"
    check_resume_config(saved, rank(1).config_dict())  # rank 1 resumes
    check_resume_config(saved, to_dict(load_config(None, ["model.device=cuda"])))  # so does the --processes check


def test_a_checkpoint_past_the_last_logged_step_is_skipped(tmp_path):
    """A resume from iter-2 cut the metrics to step 2 and was killed before it replaced iter-3 and iter-4."""
    run = _run_with(tmp_path, 4)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(3)))
    found = latest_good_checkpoint(run)
    assert found.path.name == "iter-000002" and len(found.warnings) == 2
    assert "iter-000004: past the run's last logged step 2 (left by a resume from an earlier" in found.warnings[0]
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(5)))
    assert latest_good_checkpoint(run).path.name == "iter-000004"  # a run that got there: its newest


def test_metrics_that_lost_rows_are_named_not_blamed_on_the_checkpoints(tmp_path):
    """Every checkpoint past a truncated metrics.jsonl: it said "none of its 2 checkpoints verifies; start a new
    run" though both verify; one checkpoint folder resumed with a silent gap in the metrics."""
    from flowrl.resume import find_resume

    run = _run_with(tmp_path, 2)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError) as err:
        latest_good_checkpoint(run)
    assert str(err.value) == (
        f"--resume {run}: its metrics.jsonl ends at step 0, before every checkpoint (newest iter-000002): rows were "
        f"lost (truncated or edited); restore metrics.jsonl, or resume from one checkpoint folder "
        f"({run / 'checkpoints' / 'iter-000002'}), leaving the missing rows missing"
    )
    found = find_resume(run / "checkpoints" / "iter-000002")
    assert found.warnings == [
        f"{run / 'metrics.jsonl'} ends at step 0, before this checkpoint's 2: the run's "
        "metrics will have no rows from 1 to 2"
    ]


def test_no_checkpoint_verifies(tmp_path):
    run = _run_with(tmp_path, 2)
    for folder in (run / "checkpoints").iterdir():
        (folder / "manifest.json").unlink()
    with pytest.raises(ValueError, match="none of its 2 checkpoints verifies .newest: checkpoint .*iter-000002"):
        latest_good_checkpoint(run)
    with pytest.raises(FileNotFoundError, match="no checkpoints/iter-N"):
        latest_good_checkpoint(tmp_path / "empty")


def test_prune_keeps_the_newest_and_those_ahead(tmp_path):
    run = _run_with(tmp_path, 4)
    prune_checkpoints(run, keep=2, upto=3)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000002", "iter-000003", "iter-000004"]


def test_config_fingerprint():
    saved = to_dict(load_config(None, ["optim.lr=0.003"]))
    check_resume_config(saved, to_dict(load_config(None, ["optim.lr=0.003", "train.iterations=500"])))
    check_resume_config(saved, to_dict(load_config(None, ["optim.lr=0.003", "output.dir=elsewhere"])))
    check_resume_config(None, to_dict(load_config()))  # an old checkpoint without a stored config
    older = json.loads(json.dumps(saved))
    del older["output"]["keep_checkpoints"]  # a key added to flowrl later compares as its default
    del older["train"]["seed"]
    check_resume_config(older, to_dict(load_config(None, ["optim.lr=0.003"])))
    with pytest.raises(ValueError, match=r"train.seed changed from 0 to 1"):
        check_resume_config(older, to_dict(load_config(None, ["optim.lr=0.003", "train.seed=1"])))
    with pytest.raises(ValueError, match=r"^--resume: optim.lr changed from 0.003 to 0.01 since the checkpoint"):
        check_resume_config(saved, to_dict(load_config(None, ["optim.lr=0.01"])))
    added = to_dict(load_config(None, ["optim.lr=0.003", "rewards.jpeg_compressibility.weight=1.0"]))
    with pytest.raises(ValueError, match=r"reward 'jpeg_compressibility' \(rewards.jpeg_compressibility\) was added"):
        check_resume_config(saved, added)
    # the reward-deadline error says "raise rewards.<name>.timeout_s": a resume may do that
    check_resume_config(saved, to_dict(load_config(None, ["optim.lr=0.003", "rewards.ink_band.timeout_s=1200"])))
    with pytest.raises(ValueError, match=r"rewards.ink_band.weight changed from 1.0 to 2.0"):
        check_resume_config(saved, to_dict(load_config(None, ["optim.lr=0.003", "rewards.ink_band.weight=2.0"])))


def test_a_reward_or_guard_added_or_removed_on_resume_is_refused_even_with_resumable_keys_only():
    """rewards.ink.timeout_s alone made ink a third trained reward of weight 1 (eval reward 1.12 -> 1.65 mid-run)."""
    guard = ["guards.diversity.tolerance=0.9", "guards.diversity.relative=true"]
    saved = to_dict(load_config(None, guard))
    for overrides, fragment in (
        ([*guard, "rewards.ink.timeout_s=30"], "reward 'ink' (rewards.ink) was added"),
        ([*guard, "guards.ink.tolerance=0.5"], "guard 'ink' (guards.ink) was added"),
        ([], "guard 'diversity' (guards.diversity) was removed"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"--resume: {fragment} since the checkpoint was written")):
            check_resume_config(saved, to_dict(load_config(None, overrides)))
    removed = json.loads(json.dumps(saved))
    removed["rewards"]["ink"] = {"weight": 1.0}
    with pytest.raises(ValueError, match=re.escape("reward 'ink' (rewards.ink) was removed")):
        check_resume_config(removed, saved)
    check_resume_config(saved, to_dict(load_config(None, [*guard, "guards.diversity.tolerance=0.8"])))  # a verdict


def test_keep_checkpoints_is_validated():
    assert load_config().output.keep_checkpoints == 3
    with pytest.raises(ConfigError, match="'output.keep_checkpoints' must be >= 1; got 0"):
        load_config(None, ["output.keep_checkpoints=0"])


# -- end to end on the embedded model (in-process CLI) ------------------------------------------


def _train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", *SMALL, *args])
    return code, capsys.readouterr().err


def test_run_falls_back_refuses_changed_config_and_prunes(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(capsys, f"output.dir={out}", "output.keep_checkpoints=2")[0] == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter-000002", "iter-000003"]
    (out / "checkpoints" / "iter-000003" / "lora.safetensors").write_bytes(b"not a tensor file")
    # no output.dir: the run folder comes from --resume
    code, err = _train(capsys, "train.iterations=4", "output.keep_checkpoints=2", "--resume", str(out))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("flowrl: warning:")]
    assert len(warnings) == 1 and "iter-000003" in warnings[0] and "lora.safetensors" in warnings[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter-000003", "iter-000004"]
    assert load_checkpoint(out / "checkpoints" / "iter-000003")["iteration"] == 3  # rewritten, verifies
    code, err = _train(capsys, "train.iterations=5", "optim.lr=0.01", "--resume", str(out))
    assert code == 2 and err.strip().splitlines() == [
        "flowrl: error: --resume: optim.lr changed from 0.001 to 0.01 since the checkpoint was written; "
        "resume with the same value or start a new run"
    ]


def _fill_disk_at_iteration_two(monkeypatch):
    """Checkpoint writes fail with ENOSPC from iteration 2's LoRA on; returns the real writer (to restore)."""
    real = ck._write_bytes

    def full(path, data):
        if "iter-000002" in str(path) and path.name == "lora.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(ck, "_write_bytes", full)
    return real


def test_run_on_a_full_disk_stops_with_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _fill_disk_at_iteration_two(monkeypatch)
    code, err = _train(capsys, f"output.dir={out}")
    assert code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("flowrl: error: checkpoint ") and "iter-000002: lora.safetensors" in line and "free" in line
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["iter-000001"]
    assert load_checkpoint(out / "checkpoints" / "iter-000001")["iteration"] == 1


def test_the_full_disk_line_names_a_resume_command_that_continues_a_configured_run(tmp_path, capsys, monkeypatch):
    """The line's command (``--resume RUN`` alone: the run's config.yaml) resumes a run trained from a config file."""
    import re
    import shlex

    out = tmp_path / "run"
    real = _fill_disk_at_iteration_two(monkeypatch)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    code, err = _train(capsys, "configs/grpo/digits_ink.yaml", f"output.dir={out}")
    assert code == 2
    command = shlex.split(re.search(r"continue with `([^`]*)`", err).group(1))
    monkeypatch.setattr(ck, "_write_bytes", real)
    assert command[:2] == ["flowrl", "train"], command
    code = main(command[1:])
    assert code == 0, capsys.readouterr().err
    assert load_checkpoint(out / "checkpoints" / "iter-000003")["iteration"] == 3


def test_resume_alone_reads_the_run_s_config_even_after_the_folder_moved(tmp_path, capsys, monkeypatch):
    """``flowrl train --resume RUN`` with no config file continues with RUN/config.yaml, overrides on top."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    first = tmp_path / "run"
    code = main(["train", "configs/grpo/digits_ink.yaml", *SMALL, f"output.dir={first}"])
    assert code == 0, capsys.readouterr().err
    moved = tmp_path / "moved"
    first.rename(moved)  # config.yaml still records output.dir = first
    code = main(["train", "train.iterations=4", "--resume", str(moved / "checkpoints" / "iter-000002")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "done: 4 iterations (2 after resuming at iteration 2) in " in out  # the wall time is this session's
    assert json.loads((moved / "summary.json").read_text())["resumed_at_iteration"] == 2
    saved = load_checkpoint(moved / "checkpoints" / "iter-000004")
    assert saved["iteration"] == 4 and not first.exists()
    resolved = load_config([moved / "config.yaml"])
    assert resolved.rewards == load_config(["configs/grpo/digits_ink.yaml"]).rewards  # not the default job's
    assert resolved.train.iterations == 4 and Path(resolved.output.dir) == moved


def test_checkpoint_folders_sort_by_iteration_number(tmp_path):
    """Newest first by the number, not the name: iter-1000000 (past the 6-digit padding) is newer than iter-999999;
    other names and plain files in checkpoints/ are ignored."""
    from flowrl.resume import checkpoint_folders

    for name in ("iter-000009", "iter-999999", "iter-1000000", "iter-000010", "iter-000011.partial", "notes"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter-000012").write_text("a file")
    names = [p.name for p in checkpoint_folders(tmp_path)]
    assert names == ["iter-1000000", "iter-999999", "iter-000010", "iter-000009"]


def test_the_last_logged_step_is_the_highest_not_the_last_row(tmp_path):
    """A row of a lower step written after the newest one (rows out of order) does not hide a logged checkpoint."""
    run = _run_with(tmp_path, 4)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (0, 1, 2, 3, 4, 1)))
    found = latest_good_checkpoint(run)
    assert found.path.name == "iter-000004" and found.warnings == []


def test_resume_from_the_checkpoints_folder_is_the_run_s_latest_good(tmp_path):
    """``--resume RUN/checkpoints`` resumes like ``--resume RUN``: its newest good checkpoint, with fallback."""
    from flowrl.resume import find_resume

    run = _run_with(tmp_path, 3)
    (run / "checkpoints" / "iter-000003" / "rng.safetensors").write_bytes(b"junk")
    found = find_resume(run / "checkpoints")
    assert found.path.name == "iter-000002" and len(found.warnings) == 1


def test_resumable_keys_are_exact_names_unless_they_end_in_a_dot():
    """train.sharding and a guard's on_trip may change on resume, but a key that merely starts with a
    resumable key's name (train.threads_per_rank vs train.threads) is compared like any other."""
    saved = to_dict(load_config(None, []))
    current = json.loads(json.dumps(saved))
    current["train"]["sharding"] = "fsdp2" if saved["train"]["sharding"] != "fsdp2" else "zero1"
    check_resume_config(saved, current)
    guarded = to_dict(load_config(None, ["guards.ink.tolerance=0.1"]))
    check_resume_config(guarded, to_dict(load_config(None, ["guards.ink.tolerance=0.1", "guards.ink.on_trip=stop"])))
    longer = json.loads(json.dumps(saved))
    longer["train"]["threads_per_rank"] = 2
    with pytest.raises(ValueError, match=r"train.threads_per_rank changed from 2 to \(absent\)"):
        check_resume_config(longer, saved)


def test_an_empty_section_gained_on_resume_is_a_change():
    """A guard added with no options (``guards.ink: {}``) where the checkpoint had none is a changed config,
    though it flattens to no leaf key (an empty mapping compares as a value)."""
    saved = to_dict(load_config(None, []))
    saved["guards"] = {}
    current = json.loads(json.dumps(saved))
    current["guards"] = {"ink": {}}
    with pytest.raises(ValueError, match=r"^--resume: guard .ink. \(guards.ink\) was added"):
        check_resume_config(saved, current)


def test_the_objective_section_compares_as_stored():
    """The objective section compares as stored, never filled from defaults: an awm run resumes with its own config,
    a changed option is refused, and an objective key the checkpoint lacks is a change even at the default value."""
    saved = to_dict(load_config(None, ["objective.name=awm"]))
    check_resume_config(saved, to_dict(load_config(None, ["objective.name=awm"])))
    with pytest.raises(ValueError, match=r"objective.power changed from 0.25 to 0.5"):
        check_resume_config(saved, to_dict(load_config(None, ["objective.name=awm", "objective.power=0.5"])))
    current = to_dict(load_config(None, []))
    older = json.loads(json.dumps(current))
    del older["objective"]["kl_beta"]
    with pytest.raises(ValueError, match=r"objective.kl_beta changed from \(absent\) to 0.004"):
        check_resume_config(older, current)


def test_resume_with_an_output_dir_override_continues_in_that_folder(tmp_path: Path, capsys) -> None:
    """``--resume A output.dir=B`` writes the continued run into B and leaves A's checkpoints as they were."""
    first, second = tmp_path / "a", tmp_path / "b"
    assert _train(capsys, f"output.dir={first}")[0] == 0
    before = sorted(p.name for p in (first / "checkpoints").iterdir())
    code, err = _train(capsys, "train.iterations=4", f"output.dir={second}", "--resume", str(first))
    assert code == 0, err
    assert json.loads((second / "summary.json").read_text())["resumed_at_iteration"] == 3
    assert load_checkpoint(second / "checkpoints" / "iter-000004")["iteration"] == 4
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == before


def test_a_run_checkpoints_its_last_iteration_and_resumes_with_a_given_config_file(tmp_path: Path, capsys) -> None:
    """The final iteration is saved off the save_every grid; ``--resume RUN FILE.yaml`` reads FILE, not RUN's config."""
    run = tmp_path / "run"
    assert _train(capsys, f"output.dir={run}", "train.save_every=2")[0] == 0  # 3 iterations
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000002", "iter-000003"]
    given = tmp_path / "more.yaml"
    given.write_text("train:\n  iterations: 4\n")
    overrides = [o for o in SMALL if not o.startswith("train.iterations=")]
    assert main(["train", str(given), *overrides, "--resume", str(run)]) == 0, capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["iterations"] == 4


def test_image_every_logs_samples_only_at_its_own_multiples(tmp_path: Path, capsys) -> None:
    """``output.image_every=2`` with ``train.eval_every=1``: sample grids at iterations 0 and 2, not at every eval."""
    run = tmp_path / "run"
    assert _train(capsys, f"output.dir={run}", "output.image_every=2")[0] == 0  # 3 iterations, eval_every=1
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["iter-000000.png", "iter-000002.png"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 3-iteration Flow-GRPO run of the embedded model (no extra adapters), checkpointed at every iteration."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *SMALL, f"output.dir={out}"]) == 0
    return out


def _add_ema_adapter(folder: Path) -> str:
    (folder / "adapter-ema.safetensors").write_bytes(ck.save({"x": torch.zeros(2)}))
    return "adapter-ema.safetensors is an adapter this run does not have (it has none); resume with the objective"


def _inflate_lora(folder: Path) -> str:
    lora = ck.load((folder / "lora.safetensors").read_bytes())
    key = sorted(lora)[0]
    lora[key] = torch.full_like(lora[key], 1e30)
    (folder / "lora.safetensors").write_bytes(ck.save(lora))
    return f"lora.safetensors: tensor '{key}' reaches |w| = 1e+30 > train.max_lora_weight=1000"


def _break_metrics_row(folder: Path) -> str:
    metrics = folder.parent.parent / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][:9], *lines[2:]]) + "\n")
    return f"{metrics}: line 2 is not valid JSON (corrupt or edited); repair or remove that line"


@pytest.mark.parametrize("tamper", [_add_ema_adapter, _inflate_lora, _break_metrics_row])
def test_a_resume_refuses_a_re_signed_tampered_run_in_one_line(finished_run, tmp_path, capsys, tamper):
    """A checkpoint edited and re-signed (checksums pass), or a metrics row broken in the middle, stops the resume
    with one line naming the file and what is wrong, before anything in the run folder changes."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    folder = run / "checkpoints" / "iter-000003"
    fragment = tamper(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"}
    (folder / "manifest.json").write_bytes(ck._manifest(files))  # signed as save_checkpoint signs
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    code, err = _train(capsys, "train.iterations=4", "--resume", str(folder))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("flowrl: error: ") and fragment in err, err
    assert {p: p.read_bytes() for p in before} == before


def test_resume_alone_of_a_run_without_its_config_yaml_says_so(finished_run, tmp_path, capsys):
    """With RUN/config.yaml deleted, --resume RUN compared the default job's config with the checkpoint's and said
    "prompts.per_iteration changed from 4 to 20"; now it names the missing file and the fix."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "config.yaml").unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"flowrl: error: --resume: {run / 'config.yaml'} is missing; restore it, or pass the run's config file(s) "
        "and overrides after --resume\n"
    )
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_the_param_group_bounds_are_the_optim_config_bounds() -> None:
    """checkpoint.py keeps its own copy of the optim.* bounds (it cannot import flowrl.config): the two agree."""
    import dataclasses

    from flowrl.checkpoint import GROUP_RANGES
    from flowrl.config import OptimConfig

    meta = {f.name: f.metadata for f in dataclasses.fields(OptimConfig)}
    assert GROUP_RANGES == {k: (meta[k]["lo"], meta[k]["hi"], meta[k]["lo_open"]) for k in GROUP_RANGES}


def test_an_empty_or_mistyped_resume_path_is_named_before_anything_else(tmp_path, capsys, monkeypatch):
    """--resume "" (an unset shell variable) trained a fresh run; a typo was blamed on the busy output folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "digits-bold-thin").mkdir(parents=True)
    (tmp_path / "runs" / "digits-bold-thin" / "metrics.jsonl").write_text("")
    assert main(["train", *SMALL, "--resume", "", "--output", str(tmp_path / "fresh")]) == 2
    err = capsys.readouterr().err
    assert (
        err == "flowrl: error: --resume must name a run folder or one of its checkpoints/iter-N; got an empty string\n"
    )
    assert not (tmp_path / "fresh").exists()
    assert main(["train", "--resume", "runs/typo"]) == 2
    assert capsys.readouterr().err.startswith("flowrl: error: --resume runs/typo: no such folder; pass a run folder")


def test_check_with_resume_runs_the_resume_s_checks(finished_run, tmp_path, capsys):
    """--check said "config OK" for a resume the run itself then refused (a changed key, no checkpoint verifying)."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    assert main(["train", "--resume", str(run), "--check"]) == 0
    assert "config OK" in capsys.readouterr().out
    assert main(["train", "--resume", str(run), "optim.lr=0.01", "--check"]) == 2
    assert "--resume: optim.lr changed from 0.001 to 0.01 since the checkpoint" in capsys.readouterr().err
    for folder in (run / "checkpoints").iterdir():
        (folder / "manifest.json").unlink()
    assert main(["train", "--resume", str(run), "--check"]) == 2
    assert "none of its 3 checkpoints verifies" in capsys.readouterr().err


def test_an_output_folder_that_is_a_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """It failed after the model load, the base grid and the start evaluation; --check said config OK."""
    import flowrl.recipe

    monkeypatch.setattr(flowrl.recipe, "build_policy", lambda *a, **k: pytest.fail("the model was built"))
    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    for out, line in (
        (afile, f"output folder {afile} is a file; set output.dir=<new folder>"),
        (afile / "sub", f"output.dir {afile / 'sub'}: {afile} is a file, not a folder"),
    ):
        for check in ([], ["--check"]):
            assert main(["train", *SMALL, "--output", str(out), *check]) == 2
            assert capsys.readouterr().err.startswith(f"flowrl: error: {line}")
    assert afile.read_text() == "keep\n"
