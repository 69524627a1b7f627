"""Checkpoint completeness: a manifest written last, checked before resuming.

The Trainer writes a checkpoint's files one after another (weights, optimizer, scheduler, RNG states, trainer state,
then each trainer's own per-process state), so a run killed while saving leaves a folder that looks like a checkpoint
but silently resumes wrong (round 0's noise, a fresh Adam). The manifest, listing every file with its size and
SHA-256, is written after all processes finished writing; a folder without it, or whose files are missing, of another
size or of other bytes (a damaged copy of the right size once resumed into NaN rewards), is refused (naming the file)
and skipped when resuming from "the latest checkpoint". Hashing reads each file once more at saving and at resuming
(about a second per GB).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

MANIFEST_NAME = "trl_dance_checkpoint.json"

logger = logging.getLogger(__name__)


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (hex), read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str, global_step: int) -> None:
    """List every file under ``folder`` (relative path → size in bytes) and its SHA-256 in ``folder/MANIFEST_NAME``,
    atomically."""
    files, digests = {}, {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name != MANIFEST_NAME:
                files[os.path.relpath(path, folder)] = os.path.getsize(path)
                digests[os.path.relpath(path, folder)] = file_digest(path)
    temporary = os.path.join(folder, MANIFEST_NAME + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"global_step": global_step, "files": files, "sha256": digests}, handle, indent=1, sort_keys=True)
    os.replace(temporary, os.path.join(folder, MANIFEST_NAME))


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` cannot be resumed from exactly, or None if its manifest and files are complete."""
    if not os.path.isdir(folder):
        return f"checkpoint {folder!r} does not exist"
    manifest = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        return (
            f"checkpoint {folder!r} has no {MANIFEST_NAME}, which trl-dance writes after every other file of a "
            "checkpoint: its save was interrupted (or an older trl-dance wrote it)"
        )
    try:
        with open(manifest) as handle:
            listed = json.load(handle)
        files, digests = listed["files"], listed.get("sha256", {})  # (manifests before checksums have none)
    except (OSError, ValueError, KeyError) as err:
        return f"checkpoint {folder!r}: {manifest} is unreadable ({err})"
    for name, size in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"checkpoint {folder!r} lacks {name}, which exact resume needs"
        if os.path.getsize(path) != size:
            return f"checkpoint {folder!r}: {name} has {os.path.getsize(path)} bytes, {size} when saved (damaged)"
        if name in digests and file_digest(path) != digests[name]:
            return f"checkpoint {folder!r}: {name} has changed since it was saved (its SHA-256 differs: damaged)"
    return None


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders in ``output_dir``, newest (largest N) first."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted((int(m.group(1)) for m in map(pattern.match, names) if m), reverse=True)
    return [os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}") for step in steps]


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder to resume from: a path as given (checked), or, for ``True`` (also the command line's
    ``"true"``), the latest complete ``checkpoint-N`` in ``output_dir``; None for None, False or ``"false"``.

    Raises:
        ValueError naming the missing or damaged file, or saying that no complete checkpoint exists.
    """
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
        resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        for folder in checkpoint_folders(output_dir):
            problem = checkpoint_problem(folder)
            if problem is None:
                return folder
            logger.warning(f"skipping {folder}: {problem}")
        raise ValueError(f"resume_from_checkpoint=True but output_dir {output_dir!r} has no complete checkpoint")
    problem = checkpoint_problem(resume_from_checkpoint)
    if problem is not None:
        raise ValueError(problem)
    return resume_from_checkpoint


def save_failure(folder: str, error: BaseException) -> str:
    """What to say when writing checkpoint ``folder`` failed with ``error``: the path, the free space on its disk,
    the size of the latest complete checkpoint beside it (what another save needs), and that the failed folder is not
    resumed from."""
    parent = os.path.dirname(folder.rstrip(os.sep)) or "."
    free = shutil.disk_usage(parent if os.path.isdir(parent) else ".").free
    message = f"writing checkpoint {folder!r} failed ({type(error).__name__}: {error}); {free / 1e9:.2f} GB free there"
    complete = [
        path
        for path in checkpoint_folders(parent)
        if path != folder.rstrip(os.sep) and os.path.isfile(os.path.join(path, MANIFEST_NAME))
    ]
    if complete:
        size = sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(complete[0]) for n in names)
        message += f", and the latest complete checkpoint ({complete[0]}) takes {size / 1e9:.2f} GB"
    return message + (
        ". The failed folder has no manifest, so resuming skips it; free space (or lower save_total_limit) and resume "
        "from the latest complete checkpoint"
    )


@contextlib.contextmanager
def named_save_failure(folder: str) -> Iterator[None]:
    """Re-raise a write that fails inside (``OSError``: ENOSPC and the like; torch's ``RuntimeError`` "basic_ios::clear:
    iostream error" on a full disk) as an ``OSError`` saying :func:`save_failure` of ``folder``, once."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if getattr(error, "_trl_dance_named", False):
            raise
        if isinstance(error, RuntimeError) and "iostream" not in str(error) and "write" not in str(error):
            raise
        named = OSError(save_failure(folder, error))
        named._trl_dance_named = True
        raise named from error


def raise_if_any_failed(accelerator, error: BaseException | None, what: str) -> None:
    """After a step that each process does on its own (its share of a save), before the barrier that follows it:
    raise ``error`` where it is set, and on every other process an error naming the rank(s) where ``what`` failed and
    the first message, so that no process waits at the barrier for one that is gone (until ``ddp_timeout``). One
    gather of a short string per call; nothing to agree on with one process."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    from accelerate.utils import gather_object

    messages = gather_object([None if error is None else f"{type(error).__name__}: {error}"])
    failed = [rank for rank, message in enumerate(messages) if message is not None]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"{what} failed on rank {', '.join(map(str, failed))} of {accelerator.num_processes}, so this process "
            f"(rank {accelerator.process_index}) stops too: {messages[failed[0]]}"
        )
