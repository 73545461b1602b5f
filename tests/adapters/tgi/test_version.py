"""Version gate of the TGI adapter: any file that differs from v3.3.7 is a loud error."""

import pytest

from vattn.adapters.tgi import version
from vattn.core.errors import UnsupportedError


def test_wrong_or_missing_files_fail_loudly(tmp_path):
    (tmp_path / "cache.py").write_text("# not TGI\n")
    with pytest.raises(UnsupportedError, match="v3.3.7") as info:
        version.check_server(tmp_path)
    assert "cache.py: expected f30f7334f8e94760" in str(info.value)
    assert "models/flash_causal_lm.py: expected 36b3a793f9d18d85, got None" in str(info.value)


def test_fingerprint_hashes_file_bytes(tmp_path):
    (tmp_path / "cache.py").write_bytes(b"")
    assert version.fingerprint(tmp_path)["cache.py"] == "e3b0c44298fc1c14"  # sha256 of b""
