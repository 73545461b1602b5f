"""``vattn bench radix``: SGLang's radix cache driving vattn's pool on the host backend."""

import json

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang (CPU import set) not installed")

from vattn.cli import main, run_command  # noqa: E402
from vattn.core.errors import ConfigError  # noqa: E402

SMALL = ["--batch", "12", "--prompt", "300", "--shared", "256", "--new", "6", "--page", "32",
         "--chunk", "700", "--max-running", "16", "--no-report"]


def _run(tmp_path, *extra):
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    assert main(["bench", "radix", *SMALL, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["generations"]


def test_the_replay_hits_what_sglang_matches_and_defers_nothing_it_should_not(tmp_path, capsys):
    """Two generations of 12 requests on a 256-token shared prefix: the first shares it once its
    first batch is in the tree, the second hits every request's whole pages below its last token
    (299 tokens -> 9 pages of 32); deferred or not, the same pages are aliased and nothing is
    left queued (the cache's audit runs at the end of every replay)."""
    plain = _run(tmp_path)
    deferred = _run(tmp_path, "--defer-mapping")
    assert "SGLang's radix cache" in capsys.readouterr().out
    assert plain[1]["cached_tokens"] == 12 * 9 * 32
    assert 0 < plain[0]["cached_tokens"] < plain[1]["cached_tokens"]
    for p, d in zip(plain, deferred):
        assert p["cached_tokens"] == d["cached_tokens"] and p["forwards"] == d["forwards"]
        assert p["calls"]["pages_aliased"] == d["calls"]["pages_aliased"]
    assert plain[0]["calls"]["calls_deferred"] == 0 < deferred[0]["calls"]["calls_deferred"]
    assert plain[0]["ms"]["issue"] == pytest.approx(0, abs=5)


def test_packs_serve_the_shared_prefix_when_staging_is_off(tmp_path):
    packed = _run(tmp_path, "--pack-mb", "4", "--pack-sets", "8", "--stage-prefixes", "off")
    total = {k: sum(g["calls"][k] for g in packed) for k in ("packs_built", "pages_packed")}
    assert packed[0]["calls"]["packs_built"] >= 1 and total["pages_packed"] > 0, total


@pytest.mark.parametrize("argv,match", [
    (["--shared", "300"], "--shared must be below --prompt"),
    (["--max-running", "4"], "--max-running"),
    (["--pool-fraction", "9"], "--pool-fraction must be in"),
])
def test_bad_input_is_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        run_command(["bench", "radix", *SMALL, *argv])
