"""A disk that fills during a checkpoint save: the error names the directory, the bytes the save
needs and the bytes free; the partial ``step_<k>.tmp-`` directory is removed at once (the space is
free for the next try); older complete checkpoints keep every byte. First the store's own block
(no process group), then whole runs on 2 gloo ranks whose writes find no space: a synchronous
save (``torch.save``) and a background one (the writer thread)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from megatron_rlhf.runtime import checkpoint_store
from megatron_rlhf.runtime.checkpoint_store import (
    DiskFullError,
    checkpoint_bytes,
    commit,
    complete_checkpoints,
    hash_files,
    removed_when_disk_full,
    unfinished_saves,
    verify_checkpoint,
)
from tests.helpers.runs import separation_config
from tests.multirank import run_on_ranks

TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _complete(save_dir: Path, step: int) -> Path:
    final = save_dir / f"step_{step:08d}"
    temp = save_dir / f"{final.name}.tmp-test"
    (temp / "actor").mkdir(parents=True)
    (temp / "actor" / "shard.distcp").write_bytes(bytes(range(256)) * 40)
    (temp / "rl_state.json").write_text(f'{{"step": {step}}}')
    commit(temp, final, step, hash_files(temp, ["actor/shard.distcp", "rl_state.json"]))
    return final


def _contents(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _little_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(checkpoint_store.shutil, "disk_usage",
                        lambda path: usage._replace(free=free))


@pytest.mark.parametrize("error", [RuntimeError(TORCH_SHORT_WRITE),
                                   OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch-save", "enospc"])
def test_a_full_disk_names_directory_and_bytes_and_removes_the_partial_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    older = _complete(tmp_path, 2)
    before = _contents(older)
    _little_free(monkeypatch, 4096)
    temp = tmp_path / "step_00000004.tmp-0123abcd"
    with pytest.raises(DiskFullError) as raised, removed_when_disk_full(temp):
        (temp / "actor").mkdir(parents=True)
        (temp / "actor" / "shard.distcp").write_bytes(b"x" * 598)
        raise error
    message = str(raised.value)
    needed = checkpoint_bytes(older)
    assert needed > len(before["actor/shard.distcp"])
    assert f"no space left on device for checkpoint step_00000004 in {tmp_path}:" in message
    assert f"needs about {needed:,} bytes" in message and "the size of step_00000002" in message
    assert "4,096 bytes (0.0 MiB) free there" in message
    assert "partial save step_00000004.tmp-0123abcd was removed" in message
    assert raised.value.errno == errno.ENOSPC
    assert not temp.exists() and unfinished_saves(tmp_path) == []
    assert complete_checkpoints(tmp_path) == [older] and _contents(older) == before


def test_a_first_save_that_fills_the_disk_says_what_it_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _little_free(monkeypatch, 0)
    temp = tmp_path / "step_00000001.tmp-00000000"
    with pytest.raises(DiskFullError, match=r"needs more than 598 bytes \(0.0 MiB\) \(written "
                       r"before the disk filled\), 0 bytes \(0.0 MiB\) free there"), \
            removed_when_disk_full(temp):
        temp.mkdir()
        (temp / "rng.pt").write_bytes(b"x" * 598)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert not temp.exists()


def test_other_save_errors_pass_unchanged_and_leave_the_temp(tmp_path: Path) -> None:
    temp = tmp_path / "step_00000001.tmp-00000000"
    with pytest.raises(PermissionError), removed_when_disk_full(temp):
        temp.mkdir()
        raise PermissionError(errno.EACCES, "Permission denied")
    assert temp.is_dir()  # as before: the next save removes it


def _run_on_a_disk_that_fills(root: str, background: bool) -> str:
    """Save after steps 1 and 2; step 2's writes find no space (this rank's ``torch.save`` for a
    synchronous save; the writer thread's items for a background one). Returns the error."""
    import torch

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.models import background_save

    def full(path: object) -> bool:
        return "step_00000002" in str(path)

    if background:
        write_item = background_save._write_item

        def no_space_item(transforms, stream, *args, **kwargs):
            if full(stream.name):
                raise OSError(errno.ENOSPC, "No space left on device")
            return write_item(transforms, stream, *args, **kwargs)

        background_save._write_item = no_space_item
    else:
        save = torch.save

        def no_space_save(obj, path, *args, **kwargs):
            if full(path):
                raise RuntimeError(TORCH_SHORT_WRITE)
            return save(obj, path, *args, **kwargs)

        torch.save = no_space_save
    config = separation_config(root, "run", 3, checkpoint={
        "save_dir": f"{root}/ckpt", "save_interval": 1, "async_save": background})
    try:
        run_ppo(config)
    except DiskFullError as error:
        return str(error)
    except BaseException as error:  # noqa: BLE001 - a rank without writes of its own
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_a_run_whose_disk_fills_names_it_and_keeps_the_older_checkpoint(
        tmp_path: Path, background: bool) -> None:
    errors = run_on_ranks(_run_on_a_disk_that_fills, world_size=2,
                          args=(str(tmp_path), background), timeout_s=500)
    save_dir = tmp_path / "ckpt"
    # rank 0 writes in every case; under separation rank 1 holds no trained shards to write in
    # the background, and megatron gives the writers' errors to rank 0 alone
    named = f"no space left on device for checkpoint step_00000002 in {save_dir}: the save "
    assert errors[0].startswith(named + "needs about "), errors
    assert "(the size of step_00000001)" in errors[0] and "free there" in errors[0], errors
    if not background:
        # rank 0 alone writes megatron's common state: rank 1 either finds the disk full too or
        # hears of it from rank 0 in the next collective (the fault report names rank 0's error)
        assert errors[1].startswith(named) or f"rank 0 raised DiskFullError: {named}" in errors[1]
    assert unfinished_saves(save_dir) == []
    saved = complete_checkpoints(save_dir)
    assert [p.name for p in saved] == ["step_00000001"] and verify_checkpoint(saved[0]) == []
