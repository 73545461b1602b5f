"""``retry_driver`` (a cache call retried while its driver call fails) and ``env_int``."""

import pytest

from vattn.core.config import env_int
from vattn.core.errors import ConfigError, DriverError, retry_driver


def _flaky(fails: int):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= fails:
            raise DriverError("map", {}, f"fault {len(calls)}")
        return "done"
    return call, calls


def test_retried_until_it_works_and_each_retry_is_counted():
    call, calls = _flaky(2)
    retried = []
    assert retry_driver(call, 2, lambda: retried.append(1)) == "done"
    assert len(calls) == 3 and len(retried) == 2


def test_the_last_error_propagates_after_the_retries():
    call, calls = _flaky(5)
    with pytest.raises(DriverError, match="fault 3"):
        retry_driver(call, 2)
    assert len(calls) == 3


def test_other_errors_are_not_retried():
    calls = []

    def call():
        calls.append(1)
        raise ValueError("not a driver fault")
    with pytest.raises(ValueError):
        retry_driver(call, 3)
    assert len(calls) == 1
    with pytest.raises(ConfigError, match="retries must be >= 0, got -1"):
        retry_driver(lambda: None, -1)


def test_env_int(monkeypatch):
    monkeypatch.delenv("VATTN_TEST_INT", raising=False)
    assert env_int("VATTN_TEST_INT", 4) == 4 and env_int("VATTN_TEST_INT") is None
    monkeypatch.setenv("VATTN_TEST_INT", " ")
    assert env_int("VATTN_TEST_INT", 4) == 4
    monkeypatch.setenv("VATTN_TEST_INT", "7")
    assert env_int("VATTN_TEST_INT", 4, minimum=0) == 7
    monkeypatch.setenv("VATTN_TEST_INT", "-1")
    with pytest.raises(ConfigError, match=r"VATTN_TEST_INT must be an integer >= 0, got '-1'"):
        env_int("VATTN_TEST_INT", minimum=0)
    monkeypatch.setenv("VATTN_TEST_INT", "two")
    with pytest.raises(ConfigError, match=r"VATTN_TEST_INT must be an integer, got 'two'"):
        env_int("VATTN_TEST_INT")


def test_driver_retries_reads_the_one_variable(monkeypatch):
    from vattn.core.config import DRIVER_RETRIES_ENV, driver_retries
    monkeypatch.delenv(DRIVER_RETRIES_ENV, raising=False)
    assert driver_retries() == 2 and driver_retries(5) == 5
    monkeypatch.setenv(DRIVER_RETRIES_ENV, "0")
    assert driver_retries() == 0 and driver_retries(3) == 3
    monkeypatch.setenv(DRIVER_RETRIES_ENV, "-2")
    with pytest.raises(ConfigError, match="VATTN_DRIVER_RETRIES must be an integer >= 0, got '-2'"):
        driver_retries()
