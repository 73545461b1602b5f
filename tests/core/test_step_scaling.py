"""Per-step host work must not grow with the slot count (engines' default sizing has thousands).

Engines size vattn from their own defaults (vLLM: ``max_num_seqs`` 1024 on a large GPU; SGLang:
up to 4,096 request rows), while a workload may run a few hundred requests. The pool is
pre-warmed evenly over every slot (no minimum depth), so busy requests outgrow their share and take pages from idle
slots. These tests count the Python calls vattn makes on the engine's thread (deterministic, not
wall time) for one decode step with few and with many slots, and the driver calls of a repeated
generation.
"""

import pytest

from tests.core._util import SMALL_PAGE, count_calls, make_cache

def _decode_run(slots: int, *, batch: int = 16, prompt: int = 100, steps: int = 300):
    """Pre-warm, admit ``batch`` requests, decode ``steps`` tokens (one ``step`` per token, the
    worker drained after each so runs are deterministic), release, admit again.

    Returns ``(cache metrics after the run, max calls per decode step, driver calls of the
    second generation)``.
    """
    cache = make_cache(max_slots=slots, max_context=512, map_ahead_tokens=128,
                       page_budget=(max(2 * slots, 10 * batch) + 4) * SMALL_PAGE)
    try:
        per_set = int(cache.layout.tokens_per_page)
        assert cache.prewarm(min_tokens=0) > 0 and prompt <= per_set < prompt + steps   # outgrown
        at_start = cache.metrics()["pages_mapped_on_demand"]                # the padding slot's
        worst = 0
        for gen in range(2):
            before = cache.metrics()
            reqs = [cache.acquire(expected_len=prompt) for _ in range(batch)]
            assert cache.ensure(reqs, [prompt] * batch) == []
            for n in range(prompt + 1, prompt + steps + 1):
                calls = count_calls(lambda n=n: cache.step(reqs, [n] * batch), prefix="vattn.core.")
                cache.wait()
                worst = max(worst, calls) if gen == 0 else worst
            for s in reqs:
                cache.release(s)
            cache.audit()
        after = cache.metrics()
        second = {k: after[k] - before[k] for k in ("map_calls", "unmap_calls")}
        return dict(after, on_demand=after["pages_mapped_on_demand"] - at_start), worst, second
    finally:
        cache.close()


@pytest.fixture(scope="module")
def runs():
    return {slots: _decode_run(slots) for slots in (32, 2048)}


def test_per_step_host_calls_do_not_grow_with_the_slot_count(runs):
    few, many = runs[32][1], runs[2048][1]
    assert many <= few * 1.1 + 5, f"{few} calls per step with 32 slots, {many} with 2048"


def test_growth_past_the_prewarmed_share_is_mapped_off_the_critical_path(runs):
    for slots, (m, _, _) in runs.items():
        assert m["on_demand"] == 0, (slots, m)
        assert m["pages_reclaimed"] > 0 and m["pages_mapped_ahead"] > 0, (slots, m)
        assert m["shortfalls"] == 0 and m["fence_waits"] == 0, (slots, m)


def test_a_repeated_generation_reuses_the_grown_slots_without_driver_calls(runs):
    for slots, (_, _, second) in runs.items():
        assert second == {"map_calls": 0, "unmap_calls": 0}, (slots, second)
