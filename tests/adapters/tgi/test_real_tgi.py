"""The adapter against TGI's real ``text_generation_server`` (skipped where it is not installed)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("text_generation_server") is None,
                                reason="TGI's server (text_generation_server v3.3.7) is not installed; "
                                       "it is not on any package index, install it from TGI's repository")


def test_version_fingerprint_matches_v3_3_7():
    from vattn.adapters.tgi.version import check_server
    assert check_server() == "3.3.7"


def test_hook_patches_and_store_attention_release_with_real_modules():
    probe = Path(__file__).with_name("_real_tgi_probe.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_")}
    res = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert "applied ['attention_package', 'cache', 'flash_causal_lm']" in lines
    # On CPU the flash model files stop at CUDA-only kernels (moe_kernels) after the attention
    # package; vattn's replacement of that package must never be the failing import.
    assert "from 'text_generation_server.layers.attention'" not in res.stderr
    assert "decode_matches" in lines and "released_on_delete" in lines
    assert "real_batch_bind_filter" in lines
