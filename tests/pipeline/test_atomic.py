"""Crash-safe writes: nothing half-written is visible, one winner for exclusive creates, a lock that
serialises processes, disk-full as a one-line UserError, and stale temp cleanup."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.pipeline import atomic as A
from peagle.schemas.errors import UserError


def test_atomic_write_publishes_whole_files_and_leaves_no_temp(tmp_path):
    target = tmp_path / "x.json"
    A.atomic_write_json(target, {"b": 1, "a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}
    A.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_canonical_json_is_independent_of_key_order():
    assert A.canonical_json({"b": 1, "a": {"d": 2, "c": 3}}) == A.canonical_json({"a": {"c": 3, "d": 2}, "b": 1})
    assert A.canonical_json({}).endswith(b"\n")


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "x.bin"
    A.atomic_write_bytes(target, b"old")

    class Boom(Exception):
        pass

    real_publish = A.publish

    def exploding_publish(tmp, path):
        raise Boom

    A.publish = exploding_publish
    try:
        with pytest.raises(Boom):
            A.atomic_write_bytes(target, b"new")
    finally:
        A.publish = real_publish
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_atomic_dir_publishes_a_whole_directory_or_keeps_the_old_one(tmp_path):
    final = tmp_path / "out"
    with A.atomic_dir(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "a").write_bytes(b"1")
        os.chmod(tmp / "a", 0o600)  # as safetensors writes its files
    umask = os.umask(0)
    os.umask(umask)
    assert (final / "a").read_bytes() == b"1" and (final / "a").stat().st_mode & 0o777 == 0o666 & ~umask
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    with A.atomic_dir(final) as tmp:  # replaces the old directory whole
        (tmp / "b").write_bytes(b"2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    with pytest.raises(RuntimeError, match="writer died"), A.atomic_dir(final) as tmp:
        (tmp / "c").write_bytes(b"half")
        raise RuntimeError("writer died")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or renamed-away directory left
    with pytest.raises(UserError, match="no space left writing"), A.atomic_dir(final):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_remove_dir(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    A.remove_dir(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


def _create(args) -> bool:
    path, payload = args
    return A.create_exclusive(path, payload)


def test_create_exclusive_has_exactly_one_winner_across_processes(tmp_path):
    path = str(tmp_path / "settings.json")
    payloads = [f"writer {i}\n".encode() * 1000 for i in range(8)]
    with mp.get_context("fork").Pool(4) as pool:
        won = pool.map(_create, [(path, p) for p in payloads])
    assert sum(won) == 1
    assert Path(path).read_bytes() == payloads[won.index(True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]


def _increment(args) -> None:
    lock, counter, times = args
    for _ in range(times):
        with A.file_lock(lock):
            n = int(Path(counter).read_text())
            Path(counter).write_text(str(n + 1))


def test_file_lock_serialises_read_modify_write_across_processes(tmp_path):
    counter = tmp_path / "n"
    counter.write_text("0")
    with mp.get_context("fork").Pool(4) as pool:
        pool.map(_increment, [(str(tmp_path / ".lock"), str(counter), 50)] * 4)
    assert counter.read_text() == "200"


HOLD = """
import sys, time
from peagle.pipeline.atomic import file_lock
with file_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_waiter_names_the_holder_of_a_lock_and_goes_on_waiting(tmp_path, monkeypatch):
    """The holder records pid, host and start in the lock file (emptied when it lets go); a waiter says
    who holds it once LOCK_NOTE_S has passed, again every LOCK_NOTE_EVERY_S, and takes the lock once free."""
    import socket
    import threading
    import time

    monkeypatch.setattr(A, "LOCK_NOTE_S", 0.3)
    monkeypatch.setattr(A, "LOCK_NOTE_EVERY_S", 0.3)
    lock = tmp_path / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    said: list[str] = []
    try:
        assert holder.stdout.readline().strip() == "held"
        assert json.loads(lock.read_text())["pid"] == holder.pid
        threading.Timer(1.5, holder.kill).start()
        started = time.monotonic()
        with A.file_lock(lock, say=said.append):
            waited = time.monotonic() - started
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(30)
    assert waited >= 1.0 and len(said) >= 2 and lock.read_text() == ""
    assert said[0].startswith(f"waiting 0 s for the lock {lock}, held by pid {holder.pid} on {socket.gethostname()} "
                              "since ") and "still waiting" in said[0]


def test_a_lock_file_that_is_a_link_is_refused_and_a_hard_linked_one_never_written(tmp_path):
    victim = tmp_path / "record.json"
    victim.write_text('{"kept": true}')
    (tmp_path / "link.lock").symlink_to(victim)
    with pytest.raises(UserError, match="link.lock is a symbolic link; a lock file is a plain file"):
        with A.file_lock(tmp_path / "link.lock"):
            pass
    os.link(victim, tmp_path / "hard.lock")
    with A.file_lock(tmp_path / "hard.lock"):
        assert victim.read_text() == '{"kept": true}'
    assert victim.read_text() == '{"kept": true}'


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_disk_full_errors_become_one_line_user_errors(code):
    with pytest.raises(UserError, match="no space left writing /s/x") as info:
        A.raise_if_disk_full(OSError(code, os.strerror(code)), "/s/x")
    assert "\n" not in str(info.value)
    A.raise_if_disk_full(OSError(errno.EACCES, "denied"), "/s/x")  # other errors are not ours to reword


def test_a_real_file_size_limit_is_reported_as_disk_full_without_leftovers(tmp_path):
    """RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk would (with SIGXFSZ ignored)."""
    code = (
        "import resource, signal, sys\n"
        "from peagle.pipeline.atomic import atomic_write_bytes\n"
        "from peagle.schemas.errors import UserError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    atomic_write_bytes({str(tmp_path / 'big.bin')!r}, b'x' * 100000)\n"
        "except UserError as err:\n"
        "    print(err); sys.exit(2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("no space left writing") and proc.stdout.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_temps_removes_only_dead_writers_files(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".00001.parquet.tmp-{dead.pid}-abc"
    live = tmp_path / f".00002.parquet.tmp-{os.getpid()}-def"
    kept = tmp_path / "00003.parquet"
    for p in (stale, live, kept):
        p.write_bytes(b"x")
    assert A.remove_stale_temps(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, kept.name])
    assert A.remove_stale_temps(tmp_path / "missing") == 0


def test_temp_names_are_unique_and_hidden(tmp_path):
    a, b = A.temp_path_for(tmp_path / "f.json"), A.temp_path_for(tmp_path / "f.json")
    assert a != b and a.name.startswith(".f.json.tmp-") and a.exists()


def test_failpoint_kills_the_process_at_the_nth_hit():
    code = ("from peagle.pipeline.failpoints import failpoint\n"
            "for i in range(5):\n    failpoint('x.y')\n    print(i, flush=True)\n")
    for spec, printed in (("x.y", ""), ("x.y:3", "0\n1\n"), ("other", "0\n1\n2\n3\n4\n")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PEAGLE_FAILPOINT": spec})
        assert proc.stdout == printed
        assert proc.returncode == (0 if spec == "other" else -signal.SIGKILL)



def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_atomic_dir_swaps_an_existing_directory_in_one_step(tmp_path):
    """Replacing a directory never leaves ``final`` missing: it is swapped with the new one in one
    rename (RENAME_EXCHANGE), so at every instant ``final`` is the old or the new directory."""
    final = tmp_path / "out"
    with A.atomic_dir(final) as tmp:
        (tmp / "old").write_bytes(b"1")
    inode = final.stat().st_ino
    with A.atomic_dir(final) as tmp:
        (tmp / "new").write_bytes(b"2")
        new_inode = tmp.stat().st_ino
    assert sorted(p.name for p in final.iterdir()) == ["new"] and final.stat().st_ino == new_inode != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_bytes(b"a")
    assert A.exchange(a, b) and (b / "x").read_bytes() == b"a" and not (a / "x").exists()


def test_clean_dead_dirs_removes_only_what_dead_writers_of_that_name_left(tmp_path):
    """By name and owner pid, never anything else: a live writer's directory, another name's, and a
    file that only looks alike stay."""
    final, dead, live = tmp_path / "out", _dead_pid(), os.getpid()
    gone = [f".out.tmp-{dead}-abc_12", f".out.deleted-{dead}"]
    kept = [f".out.tmp-{live}-xyz", f".outer.tmp-{dead}-abc", f".out.tmp-x{dead}-abc", "out.tmp-1-abc"]
    for name in gone + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
    assert sorted(p.name for p in A.clean_dead_dirs(final)) == sorted(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_a_kill_between_the_two_renames_is_undone_by_the_next_writer(tmp_path):
    """Where the file system cannot swap, the old directory is renamed away first; a writer killed
    before the second rename leaves ``final`` missing and the old one beside it, which the next
    ``atomic_dir(final)`` (any writer of it) puts back before it starts."""
    final, new = tmp_path / "out", tmp_path / ".out.tmp-new"
    for d, name in ((final, "old"), (new, "new")):
        d.mkdir()
        (d / name).write_bytes(name.encode())
    code = ("import sys\nfrom pathlib import Path\nfrom peagle.pipeline.atomic import replace_in_two_renames\n"
            "replace_in_two_renames(Path(sys.argv[1]), Path(sys.argv[2]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(new), str(final)], timeout=120,
                          env={**os.environ, "PEAGLE_FAILPOINT": "dir.between_renames"})
    assert proc.returncode == -signal.SIGKILL
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.replaced-")]
    assert not final.exists() and (aside / "old").is_file()
    A.clean_dead_dirs(final)
    assert sorted(p.name for p in final.iterdir()) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-new", "out"]  # a name of no pid stays
    A.replace_in_two_renames(new, final)  # uninterrupted: the new one in place, nothing beside it
    assert sorted(p.name for p in final.iterdir()) == ["new"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]

