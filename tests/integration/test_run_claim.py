"""Issue 38 item 5: one run dir has one writer at a time (the run-dir claim, core.run_claim).

The claim's rules, then two pods' entrypoints of two jobs (any names) with one run dir: the second
is refused in one line naming the holder while the first trains, and a claim its job stopped
renewing (SIGKILLed, gone) is taken once its lease runs out, never blocking for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kfp_nvrx.components.core import run_claim as rc
from kfp_nvrx.components.core.run_claim import CLAIM_FILE, Claim, read_claim, release, renew, take
from kfp_nvrx.components.errors import UserError

ENTRY = [sys.executable, "-m", "kfp_nvrx.components.core.pod_entry"]
A, B = Claim(holder="k8s:team/a", what="job team/a", pod="a-0"), \
    Claim(holder="k8s:other/b", what="job other/b", pod="b-0")


def test_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path) -> None:
    run = tmp_path / "run"
    assert take(run, A) is None  # a new run dir: created and claimed
    held = take(run, B)
    assert held is not None and held.holder == A.holder
    err = rc.in_use(run, held)
    assert err.field == "run_dir" and "job team/a (pod a-0" in err.message and "\n" not in str(err)
    assert take(run, A) is None  # the holder itself (a restarted pod, its launcher)


def test_a_claim_whose_lease_ran_out_or_whose_job_is_gone_is_taken(tmp_path) -> None:
    run = tmp_path / "run"
    take(run, A)
    assert take(run, B, gone=lambda c: c.holder == A.holder) is None  # the launcher asked
    assert read_claim(run).holder == B.holder
    stale = json.loads((run / CLAIM_FILE).read_text())
    stale["renewed"] = time.time() - stale["lease_s"] - 1
    (run / CLAIM_FILE).write_text(json.dumps(stale))
    assert take(run, A) is None and read_claim(run).holder == A.holder
    ahead = {**stale, "holder": B.holder, "renewed": time.time() + 10 * stale["lease_s"]}
    (run / CLAIM_FILE).write_text(json.dumps(ahead))  # no clock renewed it: it never blocks
    assert take(run, A) is None


def test_renew_never_takes_another_jobs_claim_and_release_only_our_own(tmp_path) -> None:
    run = tmp_path / "run"
    take(run, A)
    assert renew(run, B).holder == A.holder
    release(run, B)
    assert read_claim(run).holder == A.holder
    release(run, A)
    assert read_claim(run) is None
    assert renew(run, A) is None and read_claim(run).holder == A.holder  # released, then renewed


@pytest.mark.parametrize("content", ["", "{", "[]", '{"holder": ""}', '{"holder": "x"}',
                                     '{"holder": "x", "renewed": "soon"}',
                                     '{"holder": "x", "renewed": 1e400}',
                                     '{"holder": "x", "renewed": 1, "lease_s": 1e12}'])
def test_a_torn_or_damaged_claim_is_no_claim(tmp_path, content) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM_FILE).write_text(content)
    assert read_claim(run) is None
    assert take(run, A) is None


def test_a_link_or_fifo_in_the_claims_place_is_refused_never_followed(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="no regular file"):
        take(run, A)
    assert not (tmp_path / "elsewhere").exists()
    (run / CLAIM_FILE).unlink()
    os.mkfifo(run / CLAIM_FILE)
    with pytest.raises(UserError, match="no regular file"):
        read_claim(run)


def _pod(run, holder: str, script: str, lease: float = 4.0) -> subprocess.Popen:
    env = {**os.environ, rc.RUN_DIR_ENV: str(run), rc.HOLDER_ENV: holder,
           rc.LEASE_ENV: str(lease), "POD_NAME": f"{holder.rsplit('/', 1)[1]}-node-0"}
    return subprocess.Popen([*ENTRY, sys.executable, "-c", script], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


TRAIN = ("import pathlib, sys, time; p = pathlib.Path(sys.argv[0] if False else {run!r}); "
         "(p / 'wrote').write_text('x'); time.sleep({secs})")


def test_two_jobs_pods_with_one_run_dir_the_second_is_refused_naming_the_first(tmp_path) -> None:
    run = tmp_path / "run"
    first = _pod(run, "k8s:team/llm-a", TRAIN.format(run=str(run), secs=12))
    deadline = time.monotonic() + 30
    while read_claim(run) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    second = _pod(run, "k8s:team/llm-b", "print('trained'); open('/dev/null')")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 2, (out, err)
    assert "trained" not in out
    refusal = err.strip().splitlines()[-1]
    assert "in use by job team/llm-a (pod llm-a-node-0" in refusal, err
    assert first.wait(timeout=60) == 0
    assert read_claim(run) is None  # released at the first job's final exit


def test_a_claim_its_job_stopped_renewing_is_taken_after_its_lease(tmp_path) -> None:
    """A SIGKILLed pod renews and releases nothing: its claim runs out, the next job starts."""
    run = tmp_path / "run"
    first = _pod(run, "k8s:team/llm-a", TRAIN.format(run=str(run), secs=60), lease=3.0)
    deadline = time.monotonic() + 30
    while read_claim(run) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    first.kill()
    first.wait(timeout=30)
    second = _pod(run, "k8s:team/llm-b", "print('trained')", lease=3.0)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0 and "trained" in out, (out, err)
    assert "waiting up to" in err  # it waited the stale claim out, then took it


def test_a_pod_whose_claim_another_job_took_stops_its_trainer(tmp_path) -> None:
    run = tmp_path / "run"
    first = _pod(run, "k8s:team/llm-a", TRAIN.format(run=str(run), secs=60), lease=2.0)
    deadline = time.monotonic() + 30
    while read_claim(run) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    rc._write(run, Claim(holder="k8s:other/b", what="job other/b", lease_s=60))
    out, err = first.communicate(timeout=60)
    assert first.returncode == 2, (out, err)
    assert "stopping the trainer" in err and "in use by job other/b" in err
    assert read_claim(run).holder == "k8s:other/b"  # never released by the loser


def test_a_claimed_new_run_dir_is_one_the_trainers_first_start_accepts(tmp_path) -> None:
    """Seen on the real cluster: the claim's files alone made it "not a kfp-nvrx run dir"."""
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.run_record import check_run_dir

    run = tmp_path / "new" / "run"
    assert take(run, A) is None
    check_run_dir(run, load_config("tiny", []))


def test_a_strangers_folder_gets_no_claim_written_into_it(tmp_path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert take(folder, A) is None and renew(folder, A) is None
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
