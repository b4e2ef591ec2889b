"""The one writer of checkpoint directories: atomic writes, a manifest of checksums, verification,
pruning of ``step_<k>`` series, and reading saved files without running pickled code.

    temp = shared_temp_dir(save_dir / "step_00000004")   # every rank; stale temps removed
    ... every rank writes its files under temp ...
    publish(temp, final, step=4, keep_last=2)            # every rank: hash, manifest, rename
    path = select_checkpoint(complete_checkpoints(save_dir)[::-1])   # newest that verifies

A checkpoint is complete when its directory carries no suffix: files are written into
``step_<k>.tmp-<hex>``, every rank hashes a share of them, rank 0 writes ``manifest.json`` (size and
sha256 of every other file) last, fsyncs and renames. A killed save leaves only the ``.tmp-``
directory, which is never picked and is removed by the next save. Older checkpoints are removed
only after the rename. A save that fills the disk removes its ``.tmp-`` directory at once and
raises :class:`DiskFullError`, naming the directory, the bytes the save needs and those free
(:func:`removed_when_disk_full`).

Model checkpoints (``models.checkpoint``) and whole-run checkpoints (``engine.checkpointing``)
are both written through this module; it knows nothing about what the files hold.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})$")
_T = TypeVar("_T")
# How a write to a full disk (or one over quota) is reported: the OS's text, and torch.save's
# (its zip writer checks positions, "unexpected pos 704 vs 598", after a short write).
_DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "unexpected pos",
                    "file write failed")


def checkpoint_step(path: Path) -> int:
    """The step count in a ``step_<k>`` directory name.

    Raises:
        ValueError: not a ``step_<8 digits>`` name.
    """
    match = _NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_<8 digits>)")
    return int(match.group(1))


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``save_dir`` (renamed, with a manifest), oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=checkpoint_step)


def check_writable_dir(path: str | Path, field: str) -> None:
    """Create ``path`` if needed and check that this process can write files in it, so that a
    run finds an unusable output directory before its first step rather than at its first save.
    No process group needed; every rank may call it (the probe file is per process).

    Raises:
        ValueError: ``path`` is a file, cannot be created or cannot be written; names ``field``.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{field}={path} is an existing file, not a directory; give a "
                         "directory path")
    probe = directory / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        action = "written" if directory.is_dir() else "created"
        raise ValueError(f"{field}={path} cannot be {action} ({type(error).__name__}: "
                         f"{error.strerror or error}); give a directory this job can write, or "
                         "fix its permissions") from error


class DiskFullError(OSError):
    """A save found no space on its disk; the message names the directory, the bytes the save
    needs and the bytes free. Its partial save was removed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or that it gathers from other ranks
    (torch.distributed.checkpoint's ``CheckpointException``), is a write to a full disk."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(current).lower() for text in _DISK_FULL_TEXTS):
            return True
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(exc for exc, _ in failures.values())
        pending.extend((current.__cause__, current.__context__))
    return False


def checkpoint_bytes(path: Path) -> int:
    """The bytes of a complete checkpoint's files, manifest included (from its manifest)."""
    return (path / MANIFEST).stat().st_size + sum(
        entry["size"] for entry in read_manifest(path)["files"].values())


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):  # os.walk skips folders removed meanwhile
        for name in files:
            with contextlib.suppress(OSError):  # another rank may be removing it too
                total += os.stat(os.path.join(root, name)).st_size
    return total


@contextlib.contextmanager
def removed_when_disk_full(temp: Path) -> Iterator[None]:
    """Write a save's files into ``temp`` (a :func:`shared_temp_dir`) inside this block; when the
    disk fills, remove ``temp`` and raise :class:`DiskFullError` instead, so the space is free
    for the next try. Complete checkpoints beside it are left as they are.

    The bytes needed are the newest complete checkpoint's in the same directory (a run's
    checkpoints are all about as large), or at least what was written before the disk filled.

    Raises:
        DiskFullError: the block raised a full-disk error (:func:`is_disk_full`).
    """
    try:
        yield
    except BaseException as error:
        if not is_disk_full(error):
            raise
        written = _tree_bytes(temp)
        shutil.rmtree(temp, ignore_errors=True)
        raise DiskFullError(_disk_full_message(temp, written, error)) from error


def _disk_full_message(temp: Path, written: int, error: BaseException) -> str:
    directory = temp.parent
    free = shutil.disk_usage(directory).free
    complete = complete_checkpoints(directory)
    if complete:
        needed = (f"needs about {_size(checkpoint_bytes(complete[-1]))} (the size of "
                  f"{complete[-1].name})")
    else:
        needed = f"needs more than {_size(written)} (written before the disk filled)"
    final = temp.name.split(".tmp-")[0]
    cause = str(error).strip().splitlines()[-1][:200] if str(error).strip() else ""
    return (f"no space left on device for checkpoint {final} in {directory}: the save {needed}, "
            f"{_size(free)} free there; its partial save {temp.name} was removed and older "
            "checkpoints are untouched. Free space there (checkpoint.keep_last keeps fewer "
            f"checkpoints) or give another --save-dir ({type(error).__name__}: {cause})")


def _size(count: int) -> str:
    return f"{count:,} bytes ({count / 2**20:.1f} MiB)"


def unfinished_saves(save_dir: str | Path) -> list[Path]:
    """Temporary directories of saves that did not finish."""
    return sorted(Path(save_dir).glob("step_*.tmp-*"))


def remove_unfinished_saves(save_dir: str | Path) -> None:
    """Remove the partial saves in ``save_dir`` of a run that stops because the disk filled.

    :func:`removed_when_disk_full` removes a save's directory on the rank that hit the full
    disk, but another rank may still be writing its own files there, and learn of the failure
    only later; every rank calls this once its own writes have stopped, so the last one leaves
    none behind. Complete checkpoints are not touched.
    """
    for temp in unfinished_saves(save_dir):
        shutil.rmtree(temp, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """``manifest.json`` of a checkpoint, type-checked.

    Raises:
        ValueError: missing, not JSON, another format version, or malformed.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path / MANIFEST} cannot be read: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format_version") != MANIFEST_VERSION:
        raise ValueError(f"{path / MANIFEST}: not a format_version={MANIFEST_VERSION} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str) for v in files.values()):
        raise ValueError(f"{path / MANIFEST}: 'files' must map names to size and sha256")
    return manifest


def verify_checkpoint(path: Path, shard: int = 0, num_shards: int = 1) -> list[str]:
    """Problems of a checkpoint against its manifest: every file's size, and the sha256 of the
    files in share ``shard`` of ``num_shards`` (ranks split the hashing). [] if it is sound."""
    try:
        files = read_manifest(path)["files"]
    except ValueError as error:
        return [str(error)]
    problems = []
    for index, (name, expected) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file() or file.stat().st_size != expected["size"]:
            problems.append(f"{name} is missing or not {expected['size']} bytes")
        elif index % num_shards == shard and sha256(file) != expected["sha256"]:
            problems.append(f"{name} does not match its sha256 (corrupted)")
    return problems


def first_valid(candidates: list[Path], verify: Callable[[Path], list[str]]) -> Path:
    """The first candidate without problems; each one skipped is logged with its problems.

    Raises:
        ValueError: every candidate has problems (all are named).
    """
    rejected = []
    for path in candidates:
        problems = verify(path)
        if not problems:
            return path
        logger.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
        rejected.append(f"{path}: {'; '.join(problems)}")
    raise ValueError("no valid checkpoint to resume from:\n  " + "\n  ".join(rejected)
                     + "\nstart without --resume, or restore the files from a copy")


def select_checkpoint(candidates: list[Path]) -> Path:
    """The first candidate whose files match its manifest; collective (ranks share hashing)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def verify(path: Path) -> list[str]:
        gathered: list = [None] * world
        # World: the checkpoint holds every rank's files and each rank verifies a share.
        dist.all_gather_object(gathered, verify_checkpoint(path, rank, world),
                               group=dist.group.WORLD)
        return sorted({problem for problems in gathered for problem in problems})

    return first_valid(candidates, verify)


def read_torch_file(path: Path) -> Any:
    """A ``torch.save`` file of tensors and plain containers, read without running pickled code.

    Raises:
        ValueError: unreadable, truncated, or naming anything but tensors and plain values.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle and zip errors have many types
        raise ValueError(f"{path} cannot be read safely ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:200]}); the checkpoint is corrupted or "
                         "was not written by megatron_rlhf") from error


def shared_temp_dir(final: Path, exist_ok: bool = True, stale: str = "") -> Path:
    """Create ``<final>.tmp-<hex>`` on rank 0 and give every rank its path; collective.

    Args:
        exist_ok: whether ``final`` may exist already (it is replaced on publishing).
        stale: a glob, in ``final``'s parent, of killed saves' temporary directories to remove
            first (default: those of ``final`` itself); no other save may be running.

    Raises:
        FileExistsError: ``final`` exists and ``exist_ok`` is False.
    """
    def make() -> str:
        if final.exists() and not exist_ok:
            raise FileExistsError(f"checkpoint directory {final} already exists; choose a new "
                                  "directory or delete it first")
        final.parent.mkdir(parents=True, exist_ok=True)
        for old in sorted(final.parent.glob(stale or f"{final.name}.tmp-*")):
            shutil.rmtree(old, ignore_errors=True)
        temp = final.with_name(f"{final.name}.tmp-{secrets.token_hex(4)}")
        temp.mkdir()
        return str(temp)

    return Path(on_rank0(make))


def publish(temp: Path, final: Path, step: int | None = None,
            keep_last: int | None = None) -> None:
    """Hash every file of ``temp`` (each rank a share), write the manifest, rename ``temp`` to
    ``final`` and, for a ``step_<k>`` directory given ``keep_last``, prune; collective, after
    every rank has written its files."""
    # World: the checkpoint holds every rank's files; all must be written before hashing.
    dist.barrier(group=dist.group.WORLD)
    names = on_rank0(lambda: sorted(str(p.relative_to(temp)) for p in temp.rglob("*")
                                    if p.is_file()))
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list = [None] * world
    dist.all_gather_object(shares, hash_files(temp, names[rank::world]), group=dist.group.WORLD)
    files = {name: entry for share in shares for name, entry in share.items()}
    on_rank0(lambda: commit(temp, final, step, files, keep_last))


def hash_files(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of each named file under ``root``."""
    return {name: {"size": (root / name).stat().st_size, "sha256": sha256(root / name)}
            for name in names}


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit(temp: Path, final: Path, step: int | None, files: dict[str, dict[str, Any]],
           keep_last: int | None = None) -> None:
    """Rank 0's part of :func:`publish`: write the manifest of ``files`` (from
    :func:`hash_files`), fsync, rename ``temp`` to ``final`` (replacing an older ``final``),
    prune when ``keep_last`` is given."""
    manifest = {"format_version": MANIFEST_VERSION, "files": files}
    if step is not None:
        manifest["step"] = step
    with open(temp / MANIFEST, "w") as stream:
        json.dump(manifest, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    fsync_dir(temp)
    replaced = None
    if final.exists():  # a resumed run saves again over a step of the abandoned timeline
        replaced = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
        os.rename(final, replaced)
    os.rename(temp, final)
    fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    if keep_last is not None:
        prune(final, keep_last)


def prune(newest: Path, keep_last: int) -> None:
    """Remove checkpoints after ``newest`` (a timeline abandoned by resuming from an earlier
    step) and all but the ``keep_last`` newest up to it (0 keeps all)."""
    complete = complete_checkpoints(newest.parent)
    later = [p for p in complete if checkpoint_step(p) > checkpoint_step(newest)]
    earlier = [p for p in complete if checkpoint_step(p) < checkpoint_step(newest)]
    doomed = later + (earlier[:max(0, len(earlier) - keep_last + 1)] if keep_last else [])
    for path in doomed:
        logger.info("removing checkpoint %s", path)
        shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def on_rank0(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on rank 0 and give every rank its result (or raise its error everywhere)."""
    box: list[Any] = [(None, None)]
    if dist.get_rank() == 0:
        try:
            box[0] = (fn(), None)
        except Exception as error:  # the other ranks wait in the broadcast: tell them
            box[0] = (None, error)
    # World: every rank of the job calls this and waits for rank 0's result.
    dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
    value, error = box[0]
    if error is not None:
        raise error
    return value
