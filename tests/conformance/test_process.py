"""One engine run in a child process: its log streamed to a file, the whole process group killed
on timeout (no engine: plain Python children)."""

import sys

import pytest

from vattn.conformance.runners import process


def test_run_group_streams_the_log_and_kills_on_timeout(tmp_path):
    log = tmp_path / "run.log"
    code = "import sys, time; print('engine up', flush=True); print('oops', file=sys.stderr, flush=True); time.sleep(60)"
    with pytest.raises(process.subprocess.TimeoutExpired):
        process.run_group([sys.executable, "-c", code], {}, 8.0, str(log))   # slack for a loaded CI box
    text = log.read_text()
    assert "engine up" in text and "oops" in text and "--- exit -9" in text   # kept although killed


def test_run_group_returns_the_log_tail_as_stderr(tmp_path):
    log = tmp_path / "run.log"
    done = process.run_group([sys.executable, "-c", "import sys; sys.exit('bad things')"], {}, 30.0,
                             str(log))
    assert done.returncode == 1 and "bad things" in done.stderr
    piped = process.run_group([sys.executable, "-c", "print('hi')"], {}, 30.0)
    assert piped.stdout.strip() == "hi"
