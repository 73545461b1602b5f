"""A decode forward's host work must not grow with SGLang's request-pool size, and must not read
the device: SGLang sizes its request rows from its own defaults (up to 4,096), while a workload
may run a few; a host read of device data before a forward costs SGLang's overlap scheduler its
overlap (0.785x stock on the H200 before rows were named by request id). Counted in Python calls
into vattn (deterministic, not wall time)."""

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import Engine, new_req  # noqa: E402
from tests.core._util import count_calls  # noqa: E402


def _decode(rows: int, graphs: bool = False) -> tuple[int, int, int]:
    """Four requests decoding 40 tokens (two page boundaries each) in a pool of ``rows`` request
    rows: (most vattn calls in one decode forward's metadata, device reads, decode forwards);
    ``graphs``: decode through the platform's CUDA-graph runner (SGLang's default)."""
    e = Engine(reqs=rows, ctx=128, page_sets=48, graphs=graphs)
    reqs = [new_req(list(range(100 * i, 100 * i + 20 + i))) for i in range(4)]
    e.admit(reqs)
    worst, forwards = 0, 0
    owner = e.graph_runner if graphs else e.backend
    name = "load_batch" if graphs else "init_forward_metadata"
    prepare = getattr(owner, name)

    def counted(fb):
        nonlocal worst, forwards
        if not fb.forward_mode.is_decode():
            return prepare(fb)
        forwards += 1
        out = None

        def run():
            nonlocal out
            out = prepare(fb)
        worst = max(worst, count_calls(run))
        return out

    setattr(owner, name, counted)
    for _ in range(40):
        e.decode(reqs)
    for req in reqs:
        e.finish(req)
    e.cache.audit()
    return worst, e.pool.requests.device_reads, forwards


def test_decode_host_calls_do_not_grow_with_the_request_pool_and_read_nothing_from_the_device():
    few, reads_few, n = _decode(8)
    many, reads_many, _ = _decode(1024)
    assert n == 40
    assert many <= few * 1.1 + 5, f"{few} vattn calls per decode forward with 8 rows, {many} with 1024"
    assert reads_few == reads_many == 0


def test_graph_decode_reads_nothing_from_the_device():
    """SGLang decodes through its CUDA-graph runner by default, whose replay view of the batch has
    no request ids: the platform's runner hands them over (without them every decode step copied
    the rows to the host: 517 reads in 516 steps on the H100, 0.742x stock)."""
    few, reads, n = _decode(8, graphs=True)
    many, reads_many, _ = _decode(1024, graphs=True)
    assert n == 40
    assert many <= few * 1.1 + 5, f"{few} vattn calls per decode forward with 8 rows, {many} with 1024"
    assert reads == reads_many == 0


def test_graph_decode_without_request_ids_still_maps_right():
    """A graph runner that is not the platform's (no request ids reach the backend): the rows are
    read from the device, and every request's KV is still where it belongs."""
    from tests.adapters.sglang._engine import GraphRunner
    e = Engine(reqs=8, ctx=128, page_sets=48, graphs=True)
    e.graph_runner = GraphRunner(e.graph_runner)
    reqs = [new_req(list(range(100 * i, 100 * i + 20 + i))) for i in range(3)]
    e.admit(reqs)
    for _ in range(20):
        e.decode(reqs)                  # Engine.check: every request's rows hold its own KV
    assert e.pool.requests.device_reads == 20
    for req in reqs:
        e.finish(req)
    e.cache.audit()
