"""The checkpoint directory on its own (no process group): complete or absent, verified against
its manifest, corrupted or unfinished checkpoints skipped with a warning naming them, pruning only
of older (or abandoned) checkpoints, and files read without running pickled code."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.ppo_run import CheckpointConfig
from megatron_rlhf.engine.run.checkpointing import resume_candidates
from megatron_rlhf.runtime.checkpoint_store import (
    check_writable_dir,
    commit,
    complete_checkpoints,
    first_valid,
    hash_files,
    read_torch_file,
    unfinished_saves,
    verify_checkpoint,
)


def _save(save_dir: Path, step: int, keep_last: int = 0, payload: bytes = b"weights") -> Path:
    final = save_dir / f"step_{step:08d}"
    temp = save_dir / f"{final.name}.tmp-test"
    (temp / "actor").mkdir(parents=True)
    (temp / "actor" / "shard.distcp").write_bytes(payload * 100)
    (temp / "rl_state.json").write_text(f'{{"step": {step}}}')
    names = ["actor/shard.distcp", "rl_state.json"]
    commit(temp, final, step, hash_files(temp, names), keep_last)
    return final


@pytest.fixture
def warnings_of_store() -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    loggers = [logging.getLogger(f"megatron_rlhf.{name}")
               for name in ("runtime.checkpoint_store", "engine.run.checkpointing")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def test_a_checkpoint_is_complete_and_verifies(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    assert complete_checkpoints(tmp_path) == [path]
    assert not unfinished_saves(tmp_path)
    assert verify_checkpoint(path) == []
    assert [verify_checkpoint(path, shard, 2) for shard in (0, 1)] == [[], []]


def test_corrupted_latest_is_skipped_with_a_warning_naming_it(
        tmp_path: Path, warnings_of_store: list[str]) -> None:
    older, latest = _save(tmp_path, 1), _save(tmp_path, 2)
    shard = latest / "actor" / "shard.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(latest) == ["actor/shard.distcp does not match its sha256 "
                                         "(corrupted)"]
    assert first_valid(complete_checkpoints(tmp_path)[::-1], verify_checkpoint) == older
    assert any(str(latest) in w and "corrupted" in w for w in warnings_of_store)


def test_truncated_or_unreadable_checkpoints_are_named(tmp_path: Path) -> None:
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    (first / "rl_state.json").write_text("{")
    (second / "manifest.json").write_text("not json")
    assert verify_checkpoint(first) == ["rl_state.json is missing or not 11 bytes"]
    with pytest.raises(ValueError, match="no valid checkpoint to resume from") as error:
        first_valid(complete_checkpoints(tmp_path)[::-1], verify_checkpoint)
    assert str(first) in str(error.value) and str(second) in str(error.value)
    assert "manifest.json cannot be read" in str(error.value)


def test_old_checkpoints_are_pruned_only_after_a_new_one_is_complete(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    (tmp_path / "step_00000004.tmp-killed").mkdir()  # a save that died: nothing is pruned
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert unfinished_saves(tmp_path) == [tmp_path / "step_00000004.tmp-killed"]


def test_resuming_from_an_earlier_step_drops_the_abandoned_timeline(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    replacement = _save(tmp_path, 2, payload=b"other")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert (replacement / "actor" / "shard.distcp").read_bytes().startswith(b"other")
    assert verify_checkpoint(replacement) == []


def test_resume_candidates_newest_first_and_clear_messages(
        tmp_path: Path, warnings_of_store: list[str]) -> None:
    with pytest.raises(FileNotFoundError, match=r"--resume: no complete checkpoint in "
                       r"checkpoint.save_dir=.* \(0 unfinished saves\); start without --resume"):
        resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume=True))
    (tmp_path / "step_00000001.tmp-killed").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\(1 unfinished saves\)"):
        resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume=True))
    assert any("step_00000001.tmp-killed" in w and "unfinished save" in w
               for w in warnings_of_store)
    paths = [_save(tmp_path, step) for step in (1, 2)]
    assert resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume=True)) == paths[::-1]
    assert resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume="auto")) == \
        paths[::-1]
    with pytest.raises(FileNotFoundError, match=r"checkpoint.resume_from=.*nowhere does not "
                       "exist; name a complete step_<k> directory"):
        resume_candidates(CheckpointConfig(resume_from=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match=r"has no manifest.json \(incomplete\)"):
        resume_candidates(CheckpointConfig(resume_from=str(tmp_path / "step_00000001.tmp-killed")))


def test_a_fresh_run_refuses_a_save_dir_holding_another_runs_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    with pytest.raises(ValueError) as error:
        resume_candidates(CheckpointConfig(save_dir=str(tmp_path)))
    message = str(error.value)
    assert f"checkpoint.save_dir={tmp_path} holds 3 complete checkpoints" in message
    assert "step_00000003" in message and "--resume" in message and "--resume auto" in message
    assert "new --save-dir" in message
    elsewhere = _save(tmp_path / "other", 1)
    with pytest.raises(ValueError, match=r"checkpoint.resume_from=.*other/step_00000001 is in "
                       "another directory"):
        resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume_from=str(elsewhere)))
    assert len(complete_checkpoints(tmp_path)) == 3


def test_resume_auto_starts_fresh_only_without_a_complete_checkpoint(
        tmp_path: Path, warnings_of_store: list[str]) -> None:
    assert resume_candidates(CheckpointConfig(save_dir=str(tmp_path / "new"), resume="auto")) == []
    (tmp_path / "step_00000001.tmp-killed").mkdir()
    assert resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume="auto")) == []
    latest = _save(tmp_path, 2)
    assert resume_candidates(CheckpointConfig(save_dir=str(tmp_path), resume="auto")) == [latest]


@pytest.mark.parametrize("value, mode", [(True, "latest"), (False, "off"), ("True", "latest"),
                                         ("false", "off"), ("auto", "auto")])
def test_resume_modes_accept_booleans(tmp_path: Path, value: object, mode: str) -> None:
    assert CheckpointConfig(save_dir=str(tmp_path), resume=value).resume == mode


def test_resume_refuses_an_unknown_mode_and_auto_with_a_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint.resume='sometimes' is not one of \('off', "
                       r"'latest', 'auto'\)"):
        CheckpointConfig(save_dir=str(tmp_path), resume="sometimes")
    with pytest.raises(ValueError, match="give one of them"):
        CheckpointConfig(save_dir=str(tmp_path), resume="auto", resume_from=str(tmp_path / "x"))


def test_resuming_an_earlier_step_of_the_same_directory_names_what_it_abandons(
        tmp_path: Path, warnings_of_store: list[str]) -> None:
    paths = [_save(tmp_path, step) for step in (1, 2, 3)]
    config = CheckpointConfig(save_dir=str(tmp_path), resume_from=str(paths[0]))
    assert resume_candidates(config) == [paths[0]]
    assert any("abandons the later checkpoints step_00000002, step_00000003" in w
               for w in warnings_of_store)


def test_an_unwritable_output_directory_is_named_before_any_work(tmp_path: Path) -> None:
    check_writable_dir(tmp_path / "a" / "b", "checkpoint.save_dir")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"checkpoint.save_dir={afile} is an existing file, not "
                       "a directory"):
        check_writable_dir(afile, "checkpoint.save_dir")
    with pytest.raises(ValueError, match=r"run_dir=.*afile/sub cannot be created "
                       r"\((FileExistsError|NotADirectoryError): .*\); give a directory this "
                       "job can write"):
        check_writable_dir(afile / "sub", "run_dir")


def test_a_read_only_directory_cannot_be_written(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Root ignores permission bits, so the read-only file system is simulated at the write."""
    def refuse(self: Path, data: bytes) -> int:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(ValueError, match=r"out_dir=.* cannot be written \(PermissionError: "
                       r"Permission denied\)"):
        check_writable_dir(tmp_path, "out_dir")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran-pickled-code",))


def test_checkpoint_files_are_read_without_running_pickled_code(tmp_path: Path,
                                                                monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"state": _RunsCode()}, tmp_path / "optimizer_common.pt")
    with pytest.raises(ValueError, match="cannot be read safely .*corrupted or was not written"):
        read_torch_file(tmp_path / "optimizer_common.pt")
    assert not (tmp_path / "ran-pickled-code").exists()
    (tmp_path / "truncated.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="truncated.pt cannot be read safely"):
        read_torch_file(tmp_path / "truncated.pt")
    torch.save({"step": torch.tensor(3.0), "betas": (0.9, 0.95)}, tmp_path / "fine.pt")
    assert read_torch_file(tmp_path / "fine.pt")["betas"] == (0.9, 0.95)


def test_a_fresh_run_sets_a_previous_runs_outputs_aside(tmp_path: Path) -> None:
    from megatron_rlhf.engine.run.runner import _set_aside_previous_run

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    (tmp_path / "hf" / "step_00000003").mkdir(parents=True)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    _set_aside_previous_run(tmp_path)
    [previous] = list((tmp_path / "previous").iterdir())
    # TensorBoard would show the old run's steps beside the new run's if its events stayed.
    assert sorted(p.name for p in previous.iterdir()) == ["config.yaml", "hf", "metrics.jsonl",
                                                         "tensorboard"]
    assert (previous / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (previous / "hf" / "step_00000003").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "previous"]
    _set_aside_previous_run(tmp_path)  # nothing of a run left: nothing moves
    assert len(list((tmp_path / "previous").iterdir())) == 1
