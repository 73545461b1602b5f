import pytest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny random Llama with a word-level tokenizer (the servers need one)."""
    from vattn.conformance.models import build_model
    from vattn.conformance.tokenizer import write_tokenizer
    return write_tokenizer(build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3))
