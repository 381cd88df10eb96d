"""Output paths are checked before a command does its work; directories built whole, one builder at
a time; a file's SHA-256 (mlxlab/fsutil.py)."""

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, build_lock, fresh_output, output_file, sha256_file


def test_output_file_resolves_names_and_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_file(None, "eval.jsonl") == tmp_path / "eval.jsonl"
    assert output_file(str(tmp_path / "a.jsonl"), "eval.jsonl") == tmp_path / "a.jsonl"
    (tmp_path / "runs").mkdir()
    assert output_file(str(tmp_path / "runs"), "eval.jsonl") == tmp_path / "runs" / "eval.jsonl"
    made = output_file(str(tmp_path / "new" / "deeper") + "/", "eval.jsonl")
    assert made == tmp_path / "new" / "deeper" / "eval.jsonl" and made.parent.is_dir()
    assert output_file(str(tmp_path / "x" / "y.jsonl"), "e") == tmp_path / "x" / "y.jsonl"
    assert (tmp_path / "x").is_dir()  # its directory is made up front


def test_output_file_refuses_what_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot create directory"):
        output_file(str(tmp_path / "file" / "out.jsonl"), "eval.jsonl")
    (tmp_path / "runs" / "eval.jsonl").mkdir(parents=True)  # the default name taken by a dir
    with pytest.raises(UserError, match="is a directory"):
        output_file(str(tmp_path / "runs"), "eval.jsonl")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(UserError, match="not writable"):
                output_file(str(locked / "out.jsonl"), "eval.jsonl")
        finally:
            locked.chmod(0o700)


def test_diag_and_transcribe_check_their_out_first(tmp_path):
    from mlxlab.diag.cli import _report_path

    assert _report_path(str(tmp_path / "r"), "leak") == tmp_path / "r_leak.json"
    assert _report_path(str(tmp_path), "leak") == tmp_path / "leak.json"
    assert _report_path(str(tmp_path / "new") + "/", "leak") == tmp_path / "new" / "leak.json"
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError):
        _report_path(str(tmp_path / "f" / "r"), "leak")

    from mlxlab.audio.cli import run
    from mlxlab.audio.config import TranscribeConfig

    wav = tmp_path / "talk.wav"  # never decoded: the bad out= fails first
    with pytest.raises(UserError, match="cannot create directory"):
        run(TranscribeConfig(file=str(wav), out=str(tmp_path / "f" / "t.txt")))


def test_sha256_file_reads_in_blocks_to_the_whole_files_digest(tmp_path):
    for name, data in [("empty", b""), ("small", b"abc"), ("blocks", bytes(range(256)) * 20000)]:
        path = tmp_path / name  # "blocks": 5,120,000 bytes, more than one 4 MiB read
        path.write_bytes(data)
        assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_two_builders_of_one_directory_take_turns(tmp_path):
    """Found by a probe: a second server converting the same model removed the first one's
    temp directory as stale and the first failed. Builders now take turns; both results are
    whole, and nothing but the directory is left beside it."""
    out = tmp_path / "model"
    seen = []

    def write(tmp):
        (tmp / "a").write_text("1")
        time.sleep(0.3)  # the other builder starts meanwhile
        seen.append((tmp / "a").read_text())

    threads = [threading.Thread(target=atomic_dir, args=(out, write)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["1", "1"] and (out / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.slow
def test_a_build_lock_holds_off_another_process(tmp_path):
    out = tmp_path / "model"
    code = (
        "import sys, time; from mlxlab.fsutil import build_lock\n"
        "with build_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(2)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    t0 = time.perf_counter()
    with build_lock(out):
        waited = time.perf_counter() - t0
    holder.wait()
    assert waited > 1.0


def test_fresh_output_keeps_what_is_there_unless_forced(tmp_path, monkeypatch):
    """A CLI probe's worst find: `lora fuse/export` and `models quantize` swept away a non-empty
    out= directory (or the working directory with out=.), exit 0."""
    monkeypatch.chdir(tmp_path)
    assert fresh_output(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert fresh_output("empty") == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty; force=true replaces it"):
        fresh_output("full")
    assert fresh_output("full", force=True) == tmp_path / "full"
    (tmp_path / "a.gguf").write_text("x")
    with pytest.raises(UserError, match="an existing file; force=true"):
        fresh_output("a.gguf", kind="file")
    with pytest.raises(UserError, match="is a directory; name a file"):
        fresh_output("full", force=True, kind="file")
    for here in (".", str(tmp_path.parent)):
        with pytest.raises(UserError, match="working directory"):
            fresh_output(here, force=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_output_file_tries_the_directory_it_will_write_in():
    with pytest.raises(UserError, match="cannot write in /proc"):
        output_file("/proc/x.jsonl", "x.jsonl")


def test_a_build_leaves_a_longer_named_siblings_temp_alone(tmp_path, monkeypatch):
    """From review: `.tmp-model-*` also matched the temps of `model-q4g64` being built beside
    it; and a lock directory that cannot be trusted leaves builds working (in-process turns)."""
    sibling = tmp_path / ".tmp-model-q4g64-abcd1234"
    sibling.mkdir()
    stale = tmp_path / ".tmp-model-zz99yy88"
    stale.mkdir()
    atomic_dir(tmp_path / "model", lambda tmp: (tmp / "a").write_text("1"))
    assert sibling.exists() and not stale.exists()
    blocker = tmp_path / "tmpdir"
    blocker.mkdir()
    (blocker / f"mlxlab-locks-{os.getuid()}").write_text("not a directory")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    atomic_dir(tmp_path / "other", lambda tmp: (tmp / "b").write_text("2"))
    assert (tmp_path / "other" / "b").read_text() == "2"
