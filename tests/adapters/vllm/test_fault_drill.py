"""``VATTN_FAULT_DRILL``: driver faults at a rate inside a running vLLM worker (one rank or all)."""

from types import SimpleNamespace

import pytest

from vattn.adapters.vllm import kv_hooks, registry
from vattn.core.driver import FaultInjector, HostDriver
from vattn.core.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    yield
    registry.set_driver_wrapper(None)


@pytest.mark.parametrize("text", ["map", "map:x", "map:0", "map:1.5", "map:0.3:seed", "map:0.3:1:2",
                                  "map:0.3@one"])
def test_bad_drills_are_refused_with_the_format(monkeypatch, text):
    monkeypatch.setenv(kv_hooks.FAULT_DRILL_ENV, text)
    with pytest.raises(ConfigError, match=r"CALL:RATE\[:SEED\]\[@RANK\].*" + text.split("@")[0]):
        kv_hooks._fault_drill(0)


def test_a_drill_for_another_rank_leaves_this_one_alone(monkeypatch):
    monkeypatch.setenv(kv_hooks.FAULT_DRILL_ENV, "map:0.3:7@1")
    assert kv_hooks._fault_drill(0) is None and registry.driver_wrapper() is None


def test_a_drill_arms_the_runtime_s_driver(monkeypatch):
    monkeypatch.setenv(kv_hooks.FAULT_DRILL_ENV, "set_access:1.0:3@1")
    arm = kv_hooks._fault_drill(1)
    driver = registry.driver_wrapper()(HostDriver())
    assert isinstance(driver, FaultInjector) and not driver.rates
    arm(SimpleNamespace(cache=SimpleNamespace(driver=driver)))
    assert set(driver.rates) == {"set_access"} and driver.rates["set_access"][0] == 1.0
    driver.inner.close()


def test_unset_means_no_drill(monkeypatch):
    monkeypatch.delenv(kv_hooks.FAULT_DRILL_ENV, raising=False)
    assert kv_hooks._fault_drill(0) is None


def test_tp1_has_no_exchange():
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    assert kv_hooks._tp_exchange(config) == (0, None)
