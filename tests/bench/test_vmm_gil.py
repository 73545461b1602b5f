"""``vattn bench vmm --only contended`` on the host backend: every call timed, both sides, a row each."""

from vattn.bench.vmm_gil import CALLS, contended, markdown
from vattn.core.driver import HostDriver


def test_contended_times_every_call_beside_an_idle_and_a_busy_thread():
    drv = HostDriver(granularity=1 << 16)
    calls = []
    res = contended(drv, pages=3, rounds=2, extras={"noop": lambda: calls.append(1)})
    assert set(res) == {"idle", "busy"}
    for side in res.values():
        assert set(side) == {*CALLS, "noop"}
        assert side["map"]["n"] == side["unmap"]["n"] == 6 and side["copy"]["n"] == 4
        assert all(v["wall_mean_us"] > 0 and v["cpu_mean_us"] >= 0 for v in side.values())
    assert len(calls) == 3 * (1 + 2 + 2)                 # warm-up round + 2 rounds per side
    assert not drv._mapped                               # everything unmapped and given back
    text = markdown([("host backend", res)])
    assert text.count("| host backend |") == len(CALLS) + 1
