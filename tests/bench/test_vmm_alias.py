"""``vattn bench vmm --alias-threads``: one set of shared pages mapped into many regions (host backend)."""

import json

from vattn.bench.vmm_alias import alias_throughput, markdown
from vattn.cli import main
from vattn.core.driver import HostDriver


def test_every_region_is_mapped_and_unmapped_once_per_thread_count(monkeypatch):
    calls = {"map": 0, "unmap": 0, "set_access": 0}
    for name in calls:
        original = getattr(HostDriver, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)
        monkeypatch.setattr(HostDriver, name, counted)
    rows = alias_throughput("cpu", pages=3, regions=5, threads=[1, 2])
    assert [r["threads"] for r in rows] == [1, 2] and all(r["pages"] == 15 for r in rows)
    assert calls == {"map": 30, "unmap": 30, "set_access": 10}
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0
    assert "| 2 |" in markdown(rows, 2 << 20)


def test_the_command_writes_only_the_aliasing_table(tmp_path):
    out, doc = tmp_path / "alias.json", tmp_path / "B.md"
    assert main(["bench", "vmm", "--device", "cpu", "--only", "alias", "--alias-threads", "1,2",
                 "--alias-pages", "2", "--alias-regions", "3", "--json", str(out),
                 "--benchmarks", str(doc)]) == 0
    data = json.loads(out.read_text())
    assert data["latency"] is None and data["decode"] == [] and len(data["alias"]) == 2
    assert "Aliasing: 2 shared" in doc.read_text()


class _RecordingDriver:
    """A driver that accepts physical allocations of several pages (as CUDA's does) and records
    the sizes of its map calls."""
    granularity = 4096

    def __init__(self):
        self.maps, self.unmaps, self.access = [], [], []

    def reserve(self, size):
        return 1 << 30

    def create(self, size):
        return size

    def map(self, va, size, handle):
        assert handle == size
        self.maps.append(size)

    def set_access(self, va, size):
        self.access.append(size)

    def unmap(self, va, size):
        self.unmaps.append(size)

    def release(self, handle):
        pass

    def free_va(self, va, size):
        pass


def test_chunks_map_several_pages_with_one_call(monkeypatch):
    drv = _RecordingDriver()
    monkeypatch.setattr("vattn.bench.vmm_alias.get_driver", lambda device: drv)
    rows = alias_throughput("cuda", pages=4, regions=2, threads=[1], chunk=2)
    assert drv.maps == [2 * 4096] * 4 and drv.unmaps == drv.maps and drv.access == [4 * 4096] * 2
    assert rows[0]["pages"] == 8 and rows[0]["chunk"] == 2
    assert "one map per 2-page physical allocation" in markdown(rows, 4096)
