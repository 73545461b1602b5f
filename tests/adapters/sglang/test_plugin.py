"""Version gate and plugin registration against the installed SGLang."""

from types import SimpleNamespace

import pytest

from vattn.adapters.sglang.version import SUPPORTED_VERSIONS, check_version
from vattn.core.errors import ConfigError, UnsupportedError


def test_unsupported_version_fails_loudly():
    with pytest.raises(UnsupportedError, match="0.4.0"):
        check_version("0.4.0")
    assert check_version(SUPPORTED_VERSIONS[0]) == SUPPORTED_VERSIONS[0]


def test_register_adds_backend_and_choice():
    pytest.importorskip("sglang.srt.layers.attention.attention_registry",
                        reason="sglang (CPU import set) not installed")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from vattn.adapters.sglang.plugin import create_vattn_backend, register

    register()
    assert ATTENTION_BACKENDS["vattn"] is create_vattn_backend
    assert "vattn" in ATTENTION_BACKEND_CHOICES


def test_radix_cache_must_be_off():
    pytest.importorskip("sglang.srt.server_args", reason="sglang (CPU import set) not installed")
    from vattn.adapters.sglang.plugin import check_server_args

    with pytest.raises(ConfigError, match="disable-radix-cache"):
        check_server_args(SimpleNamespace(disable_radix_cache=False, page_size=1))
    with pytest.raises(ConfigError, match="page-size"):
        check_server_args(SimpleNamespace(disable_radix_cache=True, page_size=1))
    check_server_args(SimpleNamespace(disable_radix_cache=True, page_size=16))
