"""Errors of the machine, not of peagle, are one line too (docs/reliability.md; issue 37).

A read-only directory or file system, a file-size limit, a name too long, an input file that is not
UTF-8, a path that is not UTF-8: each used to end in a traceback. Each must end, through the real
`peagle` command, in exit 2 and exactly one line on stderr (``peagle: error: ...``) that names the
path and what to do, with nothing half-written left behind.

How the machine is made to refuse, where the tests may run as root (for whom permissions do not stop
a write): a non-root user gets a ``chmod a-w`` directory; root gets the same directory and a command
started without the capabilities that let root ignore permissions (CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH, dropped from the bounding set before exec: the kernel then checks the mode bits
against root like against anyone). A file-size limit is RLIMIT_FSIZE (EFBIG, as a full disk);
a read-only file system is a read-only bind mount, where mounting is allowed (skipped otherwise).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from faultkit import Result, ok, parallel_map, snapshot
from peagle.cli import _text_file_read
from peagle.schemas.errors import as_os_error, decode_error_line, os_error_line
from peagle.testing.warm_cli import BASE_ENV, peagle_bin

AREA = "os errors"
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _drop_dac() -> None:
    """preexec_fn: this process and what it execs lose root's right to ignore file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _file_size_limit(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def _cold(*args: str | os.PathLike | bytes, preexec: Callable[[], None] | None = None, timeout: float = 300) -> Result:
    """One real `peagle` process (a fresh interpreter: the warm runner cannot drop capabilities or set
    limits per command for what it forks)."""
    env = {**os.environ, **{k: v for k, v in BASE_ENV.items() if v is not None}}
    env.pop("PEAGLE_FAILPOINT", None)
    argv = [*peagle_bin(), *(a if isinstance(a, bytes) else str(a) for a in args)]
    res = subprocess.run(argv, capture_output=True, preexec_fn=preexec, env=env, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    shown = [os.fsdecode(a) for a in argv[len(peagle_bin()):]]
    return Result(shown, res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace"), 0.0)


def _one_line(res: Result, *needles: str) -> str | None:
    """None when the command failed as promised: exit 2, exactly one stderr line, no traceback, the needles
    in it; else what is wrong."""
    lines = res.stderr.strip().splitlines()
    if (res.returncode != 2 or "Traceback" in res.stderr or len(lines) != 1
            or not lines[0].startswith("peagle: error: ")):
        return f"expected exit 2 and one `peagle: error:` line:\n{res.describe()}"
    missing = [n for n in needles if n.lower() not in lines[0].lower()]
    return f"{missing} not in {lines[0]!r}" if missing else None


class ReadOnly:
    """Directories made read-only for the commands started with :attr:`preexec` (module docstring)."""

    def __init__(self):
        self.preexec = _drop_dac if os.geteuid() == 0 else None
        self.dirs: list[Path] = []

    def __call__(self, path: Path) -> Path:
        for p in [path, *path.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o555)
                self.dirs.append(p)
        return path

    def restore(self) -> None:
        for p in self.dirs:
            p.chmod(0o755)

    def works(self, probe: Path) -> str | None:
        """None if a command started with ``preexec`` cannot write in a read-only directory; else why."""
        probe.mkdir()
        self(probe)
        res = subprocess.run([sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"], capture_output=True,
                             text=True, preexec_fn=self.preexec)
        if res.returncode == 0:
            return "a read-only directory does not stop this user's writes here (root, and the capabilities " \
                   "that let root ignore permissions cannot be dropped)"
        return None if "PermissionError" in res.stderr else f"the probe failed otherwise: {res.stderr[-300:]}"


@pytest.fixture
def read_only(tmp_path):
    ro = ReadOnly()
    try:
        if (why := ro.works(tmp_path / "probe")) is not None:
            pytest.skip(why)
        yield ro
    finally:
        ro.restore()


def _temps(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".*tmp-*")]


def test_read_only_directories(extract_baseline, train_baseline, read_only, tmp_path, figures):
    """`peagle vocab` on a read-only (shared) store, an extract re-run into it, `train --out` and `export
    --out` under a read-only parent: one line naming the directory, nothing written."""
    store = tmp_path / "shared-store"
    shutil.copytree(extract_baseline.store, store)
    parent = tmp_path / "read-only-parent"
    parent.mkdir()
    read_only(store)
    read_only(parent)
    before = snapshot(store)
    trials = [
        ("vocab", lambda: _cold("vocab", "--store", store, "--draft-vocab-size", "64", preexec=read_only.preexec),
         (f"{store}/vocab", "Permission denied", "writes it into the store")),
        ("extract re-run", lambda: _cold(*extract_baseline.args(store), preexec=read_only.preexec),
         (str(store), "permission denied (EACCES)")),
        ("train --out", lambda: _cold(*train_baseline.args(parent / "run"), preexec=read_only.preexec),
         (f"{parent}/run", "permission denied (EACCES)")),
        ("export --out", lambda: _cold("export", train_baseline.run, "--out", parent / "export",
                                       preexec=read_only.preexec), (f"{parent}/export", "permission denied")),
    ]
    problems = [f"[{name}] {p}" for (name, _, _), p in
                zip(trials, parallel_map(lambda t: _one_line(t[1](), *t[2]), trials)) if p]
    figures.add(trials=len(trials), faults_injected=len(trials), faults_survived=len(trials) - len(problems))
    assert not problems, "\n".join(problems)
    assert snapshot(store) == before and not list(parent.iterdir())


def test_file_size_limit_in_export_and_eval(train_baseline, tmp_path, figures):
    """safetensors reports a file-size limit (EFBIG) in words, not as an OSError: `export` and `eval`
    (which exports first) still end in one line naming the export directory, and leave no temp
    directory and no partial export."""
    export, report = tmp_path / "export", tmp_path / "eval"
    limit = _file_size_limit(100_000)
    results = parallel_map(lambda args: _cold(*args, preexec=limit), [
        ("export", train_baseline.run, "--out", export),
        ("eval", train_baseline.run, "--target", train_baseline.target, "--mode", "offline", "--out", report,
         "--device", "cpu"),
    ])
    problems = [p for p in (_one_line(results[0], "no space left writing", str(export), "EFBIG"),
                            _one_line(results[1], "no space left writing", f"{report}/export", "EFBIG")) if p]
    figures.add(trials=2, faults_injected=2, faults_survived=2 - len(problems))
    assert not problems, "\n".join(problems)
    assert not export.exists() and not (report / "export").exists()
    assert not _temps(tmp_path)


def test_input_and_paths_that_are_not_utf8(extract_baseline, train_baseline, tmp_path, figures):
    """A binary or Latin-1 prompts file in `eval` names the file; a command-line path with a byte that is not
    UTF-8 is refused before anything runs (no store directory made); a name too long for the file system
    is one line."""
    binary, latin1 = tmp_path / "prompts.jsonl", tmp_path / "prompts.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    latin1.write_bytes("caf\xe9 au lait, s'il vous pla\xeet\n".encode("latin-1"))
    bad_out = os.fsencode(tmp_path) + b"/st\xffore"
    long_out = tmp_path / ("x" * 300)
    trials = [
        ("binary prompts", lambda: _cold("eval", train_baseline.run, "--target", train_baseline.target, "--mode",
                                         "online", "--prompts", binary, "--out", tmp_path / "e1", "--device", "cpu",
                                         "--max-prompts", "1", "--max-new-tokens", "2"), (str(binary), "UTF-8")),
        ("latin-1 prompts", lambda: _cold("eval", train_baseline.run, "--target", train_baseline.target, "--mode",
                                          "online", "--prompts", latin1, "--out", tmp_path / "e2", "--device", "cpu",
                                          "--max-prompts", "1", "--max-new-tokens", "2"), (str(latin1), "UTF-8")),
        ("extract --out not UTF-8", lambda: _extract_into(extract_baseline, bad_out), ("st\\xffore", "not UTF-8")),
        ("train --out too long", lambda: _cold(*train_baseline.args(long_out)), ("file name too long",)),
    ]
    problems = [f"[{name}] {p}" for (name, _, _), p in
                zip(trials, parallel_map(lambda t: _one_line(t[1](), *t[2]), trials)) if p]
    figures.add(trials=len(trials), bad_inputs_tried=len(trials), bad_inputs_handled=len(trials) - len(problems))
    assert not problems, "\n".join(problems)
    assert not os.path.exists(bad_out), "a store directory was made for a path that is refused"


def _extract_into(extract_baseline, out: bytes) -> Result:
    args = [os.fsencode(str(a)) for a in extract_baseline.args(Path("OUT"))]
    args[args.index(b"OUT")] = out
    return _cold(*args)


def test_a_store_left_holding_only_its_lock_is_harmless(extract_baseline, runner, tmp_path, figures):
    """A first run that failed early may leave the store directory holding nothing but `.lock`: the same
    command run again makes the store the uninterrupted run makes."""
    store = tmp_path / "store"
    store.mkdir()
    (store / ".lock").write_text("")
    ok(runner.run(*extract_baseline.args(store)))
    assert snapshot(store) == extract_baseline.files
    ok(runner.run("store", "verify", "--store", store))
    figures.add(trials=1, faults_injected=1, faults_survived=1)


def test_read_only_file_system(extract_baseline, tmp_path, figures):
    """A store on a read-only file system (EROFS): `vocab` and an extract re-run say so in one line."""
    store, mounted = tmp_path / "store", tmp_path / "read-only"
    shutil.copytree(extract_baseline.store, store)
    mounted.mkdir()
    for cmd in (["mount", "--bind", str(store), str(mounted)], ["mount", "-o", "remount,bind,ro", str(mounted)]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            subprocess.run(["umount", str(mounted)], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here ({(res.stderr or res.stdout).strip()}); the "
                        "EROFS line is the same code path as the permission tests")
    try:
        results = parallel_map(lambda args: _cold(*args), [
            ("vocab", "--store", mounted, "--draft-vocab-size", "64"), extract_baseline.args(mounted)])
        problems = [p for p in (_one_line(results[0], f"{mounted}/vocab", "Read-only file system"),
                                _one_line(results[1], str(mounted), "read-only file system (EROFS)")) if p]
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
    figures.add(trials=2, faults_injected=2, faults_survived=2 - len(problems))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("code, words", [
    (errno.EACCES, "permission denied (EACCES); check the permissions"),
    (errno.EPERM, "(EPERM); the system does not let this user change it"),
    (errno.EROFS, "read-only file system (EROFS); write somewhere writable"),
    (errno.ENAMETOOLONG, "file name too long (ENAMETOOLONG); a name in the path is too long"),
    (errno.EMFILE, "(EMFILE); too many files are open: raise the limit"),
    (errno.EIO, "(EIO); the disk or network file system failed"),
])
def test_every_os_error_names_the_path_and_what_to_do(code, words):
    """The table behind the CLI's line, errno by errno; a temp file is named by the file it stands for."""
    line = os_error_line(OSError(code, os.strerror(code), "/data/store/.manifest.json.tmp-4242-ab_9x"))
    assert line.startswith("/data/store/manifest.json: ") and words in line and "\n" not in line, line
    for full in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        line = os_error_line(OSError(full, os.strerror(full), "/data/x"))
        assert line.startswith("no space left writing /data/x (") and errno.errorcode[full] in line, line


def test_errors_reported_in_words_folded_or_without_a_path():
    efbig = as_os_error(RuntimeError("Error while serializing: I/O error: File too large (os error 27)"))
    assert efbig is not None and efbig.errno == errno.EFBIG
    assert as_os_error(RuntimeError("shape mismatch (dim 27)")) is None
    folded = PermissionError("Caught PermissionError in DataLoader worker process 0.\nOriginal Traceback (most "
                             "recent call last):\n  File \"x.py\", line 1\n"
                             "PermissionError: [Errno 13] Permission denied: '/s/x'")
    assert os_error_line(folded) == "[Errno 13] Permission denied: '/s/x'"
    assert os_error_line(OSError(errno.EFBIG, "File too large")).startswith("no space left writing a file (")


def test_a_decode_error_names_the_text_file_being_read(tmp_path):
    """The CLI finds the file in the frames of the error (``open``, ``Path.read_text``, a loop over lines)."""
    path = tmp_path / "p.txt"
    path.write_bytes(b"ok\n\xff\xfe\n")
    def lines() -> list[str]:
        with open(path, encoding="utf-8") as f:
            return [line for line in f]

    for read in (path.read_text, lines):
        with pytest.raises(UnicodeDecodeError) as info:
            read()
        line = decode_error_line(info.value, _text_file_read(info.value.__traceback__))
        assert line.startswith(f"{path} is not UTF-8 text (byte 0xff") and "iconv" in line, line
    assert decode_error_line(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), None).startswith("an input file is")
