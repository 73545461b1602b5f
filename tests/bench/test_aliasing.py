"""``vattn bench aliasing`` on the host backend: the three forms read the same K/V (bit-equal
outputs), the aliased form maps one physical copy into every region, and the section is written."""

from vattn.bench.aliasing import measure
from vattn.cli import run_command


def test_three_forms_read_the_same_prefix():
    r = measure((4, 2, 32, 2), device="cpu", batch=3, prefix=300)
    assert r["outputs_equal"] is True
    sets, ranges = r["page_sets_per_request"], 4 // 2
    assert sets == 3                           # 300 tokens over 128-token page-sets
    assert r["pages_aliased"] == (3 - 1) * sets * ranges
    assert r["unique_bytes"]["private"] == 3 * r["unique_bytes"]["aliased"]
    assert set(r["us"]) == {"private", "aliased", "one-region"} and min(r["us"].values()) > 0


def test_cli_writes_the_section(tmp_path):
    bm = tmp_path / "B.md"
    assert run_command(["bench", "aliasing", "--device", "cpu", "--batch", "2", "--prefix", "130",
                        "--benchmarks", str(bm), "--json", str(tmp_path / "a.json")]) == 0
    text = bm.read_text()
    assert "shared-prefix aliasing, decode" in text and "| aliased |" in text and "bit-equal" in text
