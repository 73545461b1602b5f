"""A local word-level tokenizer for the random-weight models of :mod:`.models`.

Servers (``vllm serve``, SGLang's ``launch_server``) and their benchmark clients tokenize text, so
a model directory needs a tokenizer even when its weights are random. :func:`write_tokenizer`
saves one built with the ``tokenizers`` library: token id ``i`` is the word ``"w{i}"``, except the
ids the model's ``config.json`` names as ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``,
which are the special tokens ``<s>`` / ``</s>`` / ``<pad>``. Words are split on whitespace and
decoded joined by single spaces, so ``encode(decode(ids)) == ids`` for every id sequence (the
clients' random datasets rely on that to hit their target prompt lengths). An unknown word (e.g.
an engine's warm-up text) becomes id 0 instead of failing. With a ``bos_token_id`` the tokenizer
prepends it when asked to add special tokens, as Llama tokenizers do.

Example
-------
>>> from vattn.conformance.models import build_model
>>> from vattn.conformance.tokenizer import write_tokenizer
>>> write_tokenizer(build_model("tiny", "/path/to/tiny"))
"""

from __future__ import annotations

import json
import os

from vattn.core.errors import ConfigError, UnsupportedError

__all__ = ["write_tokenizer", "has_tokenizer", "SPECIAL_NAMES", "CHAT_TEMPLATE"]

#: config.json key -> the special token written at that id
SPECIAL_NAMES = {"bos_token_id": "<s>", "eos_token_id": "</s>", "pad_token_id": "<pad>"}
#: messages joined by spaces: enough for a chat endpoint to accept a request
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}{% endif %}")
_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a ``tokenizer.json`` and a ``tokenizer_config.json``."""
    return all(os.path.exists(os.path.join(model_dir, name)) for name in _FILES)


def write_tokenizer(model_dir: str, vocab_size: int | None = None, *, overwrite: bool = False) -> str:
    """Save the word-level tokenizer of ``model_dir``'s ``config.json`` into ``model_dir``.

    Parameters
    ----------
    model_dir
        A model directory with a ``config.json`` (a :func:`~.models.build_model` output or a
        config-only model).
    vocab_size
        Tokens in the vocabulary; default the config's ``vocab_size``. Must not be below it
        (every id the model can emit must decode).
    overwrite
        Rewrite an existing tokenizer; by default one already there is kept.

    Returns
    -------
    str
        ``model_dir``.

    Raises
    ------
    ConfigError
        No ``config.json``, a vocabulary smaller than the model's or than 2, or a special token
        id outside it.
    UnsupportedError
        The ``tokenizers`` library is not installed.
    """
    config = _read_config(model_dir)
    model_vocab = config.get("vocab_size")
    size = int(vocab_size if vocab_size is not None else model_vocab or 0)
    if size < 2 or (model_vocab and size < int(model_vocab)):
        raise ConfigError(f"tokenizer vocab_size must be >= 2 and >= the model's vocab_size "
                          f"({model_vocab}), got {vocab_size!r} for {model_dir!r}")
    if has_tokenizer(model_dir) and not overwrite:
        return model_dir
    specials = _special_ids(config, size)
    tok = _build(size, specials)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    names = {name.removesuffix("_id"): SPECIAL_NAMES[name] for name in specials}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
                  int(config.get("max_position_embeddings") or 1 << 20),
                  "clean_up_tokenization_spaces": False, "add_bos_token": "bos_token_id" in specials,
                  "add_eos_token": False, "chat_template": CHAT_TEMPLATE, **names}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=1)
    with open(os.path.join(model_dir, "special_tokens_map.json"), "w") as f:
        json.dump(names, f, indent=1)
    return model_dir


def _read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"a tokenizer is written next to a model's config.json: expected "
                          f"{path!r} to exist (build the model first)")
    with open(path) as f:
        return json.load(f)


def _special_ids(config: dict, size: int) -> dict[str, int]:
    """``{"bos_token_id": 1, ...}``: the config's special ids that are set (a list: its first)."""
    found = {}
    for key in SPECIAL_NAMES:
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            continue
        if not 0 <= int(value) < size:
            raise ConfigError(f"config.json {key} must be an id below the vocab size {size}, "
                              f"got {value!r}")
        found[key] = int(value)
    return found


def _build(size: int, specials: dict[str, int]):
    try:
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    except ImportError as exc:
        raise UnsupportedError(f"writing a tokenizer needs the tokenizers library: {exc}") from exc
    by_id = {i: SPECIAL_NAMES[key] for key, i in specials.items()}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(size)}
    if len(vocab) != size:        # two special keys on one id: keep ids dense and unique
        raise ConfigError(f"config.json names one id for several special tokens: {specials}")
    unk = next(word for word, i in vocab.items() if i == 0)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(SPECIAL_NAMES[key], special=True, normalized=False)
                            for key in specials])
    if "bos_token_id" in specials:
        bos = SPECIAL_NAMES["bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, specials["bos_token_id"])])
    return tok
