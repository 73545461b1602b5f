"""``vattn bench loop``: profiled loop windows of two modes compared per function and step."""

import pytest

from vattn.bench.loop import compare, load_window, per_step
from vattn.cli import main, run_command
from vattn.core.errors import ConfigError
from vattn.core.window_profile import WindowProfile


def _spin(n):
    return sum(i * i for i in range(n))


def _extra_work(n):
    return _spin(n)


def _window(path, label, extra: int, steps=4):
    profile = WindowProfile(str(path), skip=1, steps=steps, label=label)

    def step():
        _spin(2000)
        if extra:
            _extra_work(extra)
    wrapped = profile.wrap(step, step=True)
    for _ in range(steps + 2):
        wrapped()
    assert profile.done


def test_the_mode_with_extra_work_shows_it_as_the_top_difference(tmp_path, capsys):
    _window(tmp_path / "a" / "stock-1", "stock", 0)
    _window(tmp_path / "a" / "stock-2", "stock", 0)
    _window(tmp_path / "b" / "vattn-1", "vattn", 40_000)
    stock = load_window(str(tmp_path / "a" / "stock-1.prof"))
    assert (stock["run"], stock["steps"], stock["skip"]) == ("stock", 4, 1)
    base = per_step([stock, load_window(str(tmp_path / "a" / "stock-2.prof"))])
    other = per_step([load_window(str(tmp_path / "b" / "vattn-1.prof"))])
    rows = compare(base, other, top=3)
    assert "test_loop.py" in rows[0][0] and rows[0][3] > 0     # _spin's generator: 21x the work in vattn
    extra = next(r for r in rows + compare(base, other, top=50) if "_extra_work" in r[0])
    assert extra[1] == 0.0 and extra[2] > 0 and extra[5] == pytest.approx(1.0)   # once a step, vattn only
    assert main(["bench", "loop", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## vattn vs stock:") and "; 1 / 2 windows)" in out and "_extra_work" in out
    assert "- per step, vattn: thread CPU " in out and "full collections); stock: thread CPU " in out


def test_the_unprofiled_steps_are_timed_by_kind_side_by_side(tmp_path, capsys):
    import json
    from vattn.bench.loop import step_kinds
    for folder, label, slow in (("a", "stock", 1.0), ("b", "vattn", 1.5)):
        _window(tmp_path / folder / label, label, 0)
        rows = [{"start_ms": i, "ms": (4.0 if i % 4 else 12.0 * slow), "new": 0 if i % 4 else 1} for i in range(8)]
        summary = tmp_path / folder / f"{label}.json"
        summary.write_text(json.dumps(json.loads(summary.read_text()) | {"timeline": rows}))
    kinds = step_kinds([load_window(str(tmp_path / "b" / "vattn.prof"))])
    assert kinds["decode only"] == (6, 4.0, 4.0) and kinds["with new requests"] == (2, 18.0, 18.0)
    assert main(["bench", "loop", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| with new requests | 2, 12.00 / 12.00 | 2, 18.00 / 18.00 | 1.500 |" in out
    assert "| decode only | 6, 4.00 / 4.00 | 6, 4.00 / 4.00 | 1.000 |" in out
    (tmp_path / "b" / "vattn.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a loop window summary"):
        run_command(["bench", "loop", "--results", str(tmp_path)])


def test_missing_windows_and_modes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        run_command(["bench", "loop", "--results", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="no profiled loop window"):
        run_command(["bench", "loop", "--results", str(tmp_path)])
    _window(tmp_path / "x", "vattn", 0)
    with pytest.raises(ConfigError, match="--base 'stock': no window of that mode; found vattn"):
        run_command(["bench", "loop", "--results", str(tmp_path)])
    (tmp_path / "y.prof").write_bytes(b"junk")
    (tmp_path / "y.json").write_text('{"label": "stock", "skip": 1, "steps": 4, "wall_ms": 2.0}')
    with pytest.raises(ConfigError, match="not a readable profile"):
        run_command(["bench", "loop", "--results", str(tmp_path)])


def test_the_driver_calls_of_a_window_are_counted_per_step_with_their_share(tmp_path, capsys):
    """A mode whose steps remap one page (unmap, map, set access) and copy once: the table
    counts those calls per step, by method, and sums the VMM calls apart from the copies."""
    from vattn.bench.loop import driver_calls
    from vattn.core.driver.host import HostDriver
    drv = HostDriver(granularity=4096)
    va, pages = drv.reserve(2 * 4096), [drv.create(4096), drv.create(4096)]
    drv.map(va, 4096, pages[0])
    drv.set_access(va, 4096)
    turn = [0]

    def remap():
        drv.unmap(va, 4096)
        turn[0] ^= 1
        drv.map(va, 4096, pages[turn[0]])
        drv.set_access(va, 4096)
        drv.copy(va + 64, va, 64)
    _window(tmp_path / "stock", "stock", 0)
    profile = WindowProfile(str(tmp_path / "vattn"), skip=1, steps=4, label="vattn")
    wrapped = profile.wrap(remap, step=True)
    for _ in range(6):
        wrapped()
    calls = driver_calls(per_step([load_window(str(tmp_path / "vattn.prof"))]))
    assert list(calls) == ["map", "unmap", "set_access", "copy"]
    assert all(n == pytest.approx(1.0) and us > 0 for n, us in calls.values())
    assert driver_calls(per_step([load_window(str(tmp_path / "stock.prof"))])) == {}
    assert main(["bench", "loop", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| vattn's driver call | calls/step | µs/call | µs/step | share of the mean unprofiled step (" in out
    assert "| `unmap` | 1.00 |" in out and "| **VMM calls** | 3.00 |" in out and "| **copies** | 1.00 |" in out
    import json                        # a window without its unprofiled steps: shares of the profiled one
    summary = tmp_path / "vattn.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | {"timeline": []}))
    assert main(["bench", "loop", "--results", str(tmp_path)]) == 0
    assert "| µs/step | share of the mean profiled step (" in capsys.readouterr().out
    drv.close()
