import argparse
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def test_identity_run_writes_report(tmp_path):
    from vattn.conformance import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--workload", "identity", "--device", "cpu", "--out", str(tmp_path / "r"),
                              "--models-dir", str(tmp_path / "m"), "--engine-option", "max_batch_tokens=256"])
    assert cli.run(args) == 0
    report = json.load(open(tmp_path / "r" / "conformance.json"))
    assert report["identity"]["ok"] and report["identity"]["exact_match_rate"] == 1.0
    assert report["degenerate_check"]["ok"]
    assert (tmp_path / "r" / "conformance.md").exists()
    assert "divergence.png" in report["plots"]


def test_bad_engine_option_is_rejected(tmp_path):
    from vattn.conformance import cli
    from vattn.core.errors import ConfigError
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--workload", "identity", "--engine-option", "oops", "--out", str(tmp_path),
                              "--models-dir", str(tmp_path / "m")])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        cli.run(args)
    assert not (tmp_path / "m").exists()    # refused before any model is built


def test_stage_options_instantiate_layers_num_requests(tmp_path):
    from vattn.conformance import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--workload", "decode-heavy", "--device", "cpu", "--out", str(tmp_path / "r"),
                              "--models-dir", str(tmp_path / "m"), "--weights", "instantiate", "--layers", "1",
                              "--num-requests", "3"])
    assert cli.run(args) == 0
    report = json.load(open(tmp_path / "r" / "conformance.json"))
    assert report["num_layers"] == 1 and report["num_requests"] == 3
    assert report["throughput"]["decode-heavy"]["vattn"]["ratio"] > 0
    assert not list((tmp_path / "m").glob("*/model.safetensors"))  # weights drawn at load, never written
