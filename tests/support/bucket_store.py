"""A fake remote checkpoint store: what an S3 store is, minus the network (a test double).

The "bucket" is a folder beside the run dir reached only through ``file://`` URLs with fsspec, as
an S3 store would reach ``s3://`` ones: DCP reads a step from its URL (:mod:`dcp_io`), and an
asynchronous write puts this rank's files in a local spool folder, from where :meth:`seal_files`
uploads them in NVRx's writer process; :meth:`commit` uploads ``.metadata`` and writes the
commit object. Every bit of state is in the bucket or the spool, none in this object: the writer
process gets a pickled copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec

COMMIT = "COMMIT.json"


class BucketStore:
    """A :class:`~kfp_nvrx.components.core.ckpt_store.CheckpointStore` on a fake object store."""

    kind = "bucket"

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.bucket = self.run_dir.parent / f"{self.run_dir.name}.bucket"
        self.where = f"file://{self.bucket}"
        self.progress_file = self.run_dir / "progress"
        self.fs = fsspec.filesystem("file")

    # ------------------------------------------------------------------ listing
    def name(self, step: int) -> str:
        return f"ckpt-{step:08d}"

    def location(self, step: int) -> str:
        return f"{self.where}/{self.name(step)}"

    def _key(self, step: int, name: str = "") -> str:
        return f"{self.location(step)}/{name}" if name else self.location(step)

    def entries(self) -> list[int]:
        if not self.fs.exists(self.where):
            return []
        return sorted(int(Path(p).name.split("-")[1]) for p in self.fs.ls(self.where, detail=False))

    def record(self, step: int) -> dict[str, Any] | None:
        key = self._key(step, COMMIT)
        if not self.fs.exists(key):
            return None
        with self.fs.open(key) as f:
            return json.load(f)

    def committed_steps(self) -> list[int]:
        return sorted((s for s in self.entries() if self.record(s)), reverse=True)

    def problem(self, step: int, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
        record = self.record(step)
        if record is None:
            return "no commit object"
        for name, size in record["files"].items():
            key = self._key(step, name)
            if not self.fs.exists(key) or self.fs.size(key) != size:
                return f"{name} is missing or changed"
        return None

    # ------------------------------------------------------------------ writing
    def spool(self, step: int) -> str:
        return str(self.run_dir / "spool" / self.name(step))

    def begin(self, step: int) -> str:
        shutil.rmtree(self.spool(step), ignore_errors=True)
        if self.fs.exists(self._key(step)):
            self.fs.rm(self._key(step), recursive=True)
        Path(self.spool(step)).mkdir(parents=True)
        self.fs.makedirs(self._key(step), exist_ok=True)
        return self.location(step)

    def seal_rank(self, step: int, rank: int) -> None:
        """A synchronous save wrote through fsspec straight into the bucket: nothing to upload."""

    def seal_files(self, step: int, rank: int, files: list[str]) -> None:
        """The writer process: uploads this rank's files from the spool, then drops them."""
        for path in files:
            self.fs.put_file(path, self._key(step, Path(path).name))
            os.unlink(path)

    def commit(self, step: int, world_size: int) -> int:
        spooled = Path(self.spool(step)) / ".metadata"
        if spooled.exists():  # an asynchronous save: the coordinator wrote it into the spool
            self.fs.put_file(str(spooled), self._key(step, ".metadata"))
        shutil.rmtree(self.spool(step), ignore_errors=True)
        files = {Path(p).name: self.fs.size(p) for p in self.fs.ls(self._key(step), detail=False)}
        with self.fs.open(self._key(step, COMMIT), "w") as f:
            json.dump({"step": step, "world_size": world_size, "files": files}, f)
        return sum(files.values())

    def record_progress(self, step: int) -> None:
        self.progress_file.parent.mkdir(parents=True, exist_ok=True)
        self.progress_file.write_text(f"{step}\n")

    # ------------------------------------------------------------------ withdrawing
    def withdraw_newer(self, step: int) -> tuple[list[int], str | None]:
        gone = [s for s in self.committed_steps() if s > step]
        for s in gone:
            self.fs.rm(self._key(s), recursive=True)
        return gone, None

    def finish_withdraw(self) -> None:
        pass

    def prune(self, keep: int) -> None:
        for s in self.committed_steps()[keep:]:
            self.fs.rm(self._key(s), recursive=True)
