"""The one atomic-write helper: a reader sees the old file or the new one, never a part."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_nvrx.components.core.atomic import (
    AtomicFile,
    check_output,
    check_output_folder,
    write_atomic,
)
from kfp_nvrx.components.errors import UserError


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_writes_bytes_and_text_and_replaces_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "index.json"
    assert write_atomic(target, b"old") == target
    write_atomic(target, "nouveau é")
    assert target.read_text(encoding="utf-8") == "nouveau é" and _temps(tmp_path) == []
    assert target.stat().st_mode & 0o777 == 0o644 & ~_umask()
    write_atomic(target, "secret", perms=0o600)
    assert target.stat().st_mode & 0o777 == 0o600


def test_a_process_killed_while_writing_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "COMMITTED"
    target.write_bytes(b"old marker")
    script = ("import os, signal, sys\n"
              "from kfp_nvrx.components.core.atomic import AtomicFile\n"
              "out = AtomicFile(sys.argv[1])\n"
              "out.write(b'half of a new')\n"
              "out.file.flush()\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(target)], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert target.read_bytes() == b"old marker"
    # What a crash leaves is a hidden *.tmp beside it (the drills and tests look for those).
    assert [n.startswith(".COMMITTED.") for n in _temps(tmp_path)] == [True]


def test_an_exception_or_a_full_disk_leaves_the_old_file_and_no_temp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError), AtomicFile(target) as out:
        out.write(b"partial")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old" and _temps(tmp_path) == []

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_atomic(target, "new")
    assert err.value.errno == errno.ENOSPC
    assert target.read_text() == "old" and _temps(tmp_path) == []


def test_a_link_is_refused_never_replaced_or_written_through(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(precious)
    with pytest.raises(OSError) as err:
        write_atomic(run / "events.jsonl", "ours")
    assert err.value.errno == errno.ELOOP and err.value.filename == str(run / "events.jsonl")
    assert precious.read_text() == "keep me" and (run / "events.jsonl").is_symlink()
    assert _temps(run) == []


def _special(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":  # a private /dev/null (char 1:3): only root may make one
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "directory"])
def test_fifos_devices_sockets_and_folders_are_never_replaced(tmp_path: Path, kind: str) -> None:
    """As root, `render-job --out /dev/null` once replaced the machine's /dev/null (issue 30.11)."""
    target = tmp_path / "out"
    _special(kind, target)
    mode = target.lstat().st_mode
    with pytest.raises(OSError) as err:
        write_atomic(target, "job: yaml\n")
    assert err.value.filename == str(target) and "never replaces" in err.value.strerror
    assert target.lstat().st_mode == mode and _temps(tmp_path) == []


def test_a_fifo_put_in_place_while_writing_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "job.yaml"
    out = AtomicFile(target)
    out.write(b"kind: PyTorchJob\n")
    os.mkfifo(target)  # after the first check, before the rename
    with pytest.raises(OSError) as err:
        out.commit()
    assert err.value.errno == errno.EEXIST and err.value.filename == str(target)
    assert stat.S_ISFIFO(target.lstat().st_mode) and _temps(tmp_path) == []


def test_errors_name_the_target_not_the_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError) as err:
        write_atomic(tmp_path / "missing" / "result.json", "{}")
    assert err.value.errno == errno.ENOENT
    assert err.value.filename == str(tmp_path / "missing" / "result.json")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_atomic(tmp_path / "result.json", "{}")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "result.json")


def test_check_output_refuses_before_any_work(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("x")
    for path, says in ((tmp_path / "pipe", "FIFO"), (tmp_path / "file" / "r.json", "not a folder")):
        with pytest.raises(UserError) as err:
            check_output(path, "result")
        assert err.value.field == "result" and says in err.value.message
    check_output(tmp_path / "new" / "deeper" / "r.json", "result")  # its folders come later
    check_output(tmp_path / "file", "result")  # a regular file is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "pipe"]


def test_inside_refuses_a_linked_directory_on_the_way(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(foreign)
    with pytest.raises(OSError) as err:
        write_atomic(run / "checkpoints" / "COMMITTED", "x", inside=run)
    assert err.value.errno == errno.ELOOP and err.value.filename == str(run / "checkpoints")
    assert list(foreign.iterdir()) == []
    write_atomic(run / "checkpoints" / "COMMITTED", "x")  # not asked: the caller's choice
    assert (foreign / "COMMITTED").read_text() == "x"


def test_a_writer_that_takes_a_file_name(tmp_path: Path) -> None:
    target = tmp_path / "fsdp-train.yaml"
    with AtomicFile(target, suffix=".yaml") as out:
        assert out.tmp.name.endswith(".yaml") and out.tmp.parent == tmp_path
        out.tmp.write_text("a: 1\n")  # what KFP's compiler does with package_path
    assert target.read_text() == "a: 1\n" and list(tmp_path.iterdir()) == [target]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_check_output_folder_refuses_what_is_no_folder(tmp_path: Path) -> None:
    """``run-local --out /dev/null`` ran the pipeline into a traceback per task (issue 30.17)."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "tolinked").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "tolinked")
    for path, says in (("/dev/null", "a character device, not a folder"),
                       (tmp_path / "pipe", "FIFO"), (tmp_path / "file", "a file, not a folder"),
                       (tmp_path / "dangling", "a symbolic link to nothing"),
                       (tmp_path / "file" / "out", "is not a folder")):
        with pytest.raises(UserError) as err:
            check_output_folder(path, "--out")
        assert err.value.field == "--out" and says in err.value.message, err.value.message
    for fine in (tmp_path / "tolinked", tmp_path / "linked", tmp_path / "new" / "deeper"):
        check_output_folder(fine, "--out")
