"""RequestSlots: the one request -> slot binding every adapter keeps (vLLM, TGI, transformers)."""

import pytest

from tests.core._util import make_cache
from vattn.core import SlotError
from vattn.core.requests import RequestSlots


def test_take_drop_and_rows():
    with make_cache() as cache:
        slots = RequestSlots(cache)
        a = slots.take("a", expected_len=100)
        b = slots.take("b")
        assert a != b and slots["a"] == a and slots.get("b") == b and len(slots) == 2
        assert slots.base_row("b") == b * cache.layout.rows_per_slot
        assert "a" in slots and set(slots) == {"a", "b"} and slots.as_dict() == {"a": a, "b": b}
        assert slots.drop("a") == a and "a" not in slots and slots.get("a") is None
        assert slots.drop("a") is None                  # twice: nothing more to release
        cache.audit()


def test_a_request_holds_one_slot():
    with make_cache() as cache:
        slots = RequestSlots(cache)
        slots.take(7)
        with pytest.raises(SlotError, match="already holds slot"):
            slots.take(7)
        assert len(slots) == 1 and cache.metrics()["active_slots"] == 1


def test_missing_request_is_a_slot_error():
    with make_cache() as cache:
        with pytest.raises(SlotError, match="'x' holds no vattn slot"):
            RequestSlots(cache)["x"]


def test_array_is_the_slots_in_key_order():
    with make_cache() as cache:
        slots = RequestSlots(cache)
        a, b = slots.take("a"), slots.take("b")
        got = slots.array(["b", "a", "b"])
        assert got.dtype.name == "int64" and got.tolist() == [b, a, b]
        assert slots.array([]).tolist() == []
        with pytest.raises(SlotError, match="'zz' holds no vattn slot"):
            slots.array(["a", "zz"])


def test_all_slots_busy_leaves_the_map_unchanged():
    with make_cache(max_slots=2) as cache:
        slots = RequestSlots(cache)
        slots.take(1), slots.take(2)
        with pytest.raises(SlotError):
            slots.take(3)
        assert set(slots) == {1, 2}


def test_drop_all_and_many_release_to_the_cache():
    with make_cache() as cache:
        slots = RequestSlots(cache)
        taken = [slots.take(k, expected_len=50) for k in "abcd"]
        assert cache.ensure({s: 50 for s in taken}) == []
        assert sorted(slots.drop_many(["a", "zz", "b"])) == sorted(taken[:2])
        assert sorted(slots.drop_all()) == sorted(taken[2:])
        assert len(slots) == 0 and cache.metrics()["active_slots"] == 0
        cache.audit()
