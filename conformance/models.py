"""Random-weight models built locally from a config (no hub downloads).

Every engine loads the same ``config.json`` + ``model.safetensors`` (a
``LlamaForCausalLM``), initialised with ``std = initializer_range = 0.02`` so
outputs depend on the prompt (vLLM's ``load_format="dummy"`` does not). An engine that builds
its model in-process (transformers) may skip the file: :func:`instantiate` draws the same seeded
weights directly on the device (an 8B-shaped file is 16 GB to write and read back).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from vattn.core.errors import ConfigError, UnsupportedError

__all__ = ["PRESETS", "build_model", "instantiate", "saved_weights", "check_not_degenerate", "model_shape",
           "random_prompts", "kv_bytes_per_token", "weight_bytes", "decode_traffic_bytes"]

PRESETS: dict[str, dict] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, vocab_size=1024, max_position_embeddings=4096),
    "llama3-8b-shape": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                            vocab_size=128256, max_position_embeddings=32768 + 1024, rope_theta=500000.0),
    # a 1B-class Llama (Llama-3.2-1B's attention shape: head_dim 64, GQA 4, 128K positions)
    "llama-1b-shape": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                           vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0),
}
STAMP = "vattn_model.json"


def kv_bytes_per_token(config: dict, elem_bytes: int = 2) -> int:
    """K and V bytes one token holds over all layers of a preset-style ``config`` (bf16 default)."""
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"]
            * elem_bytes)


def weight_bytes(config: dict, elem_bytes: int = 2) -> int:
    """Bytes of a preset-style Llama's weights (untied embeddings; bf16 default): what every
    decode step reads once."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    layer = h * (2 * q + 2 * kv) + 3 * h * inter + 2 * h      # q, o, k, v; gate, up, down; 2 norms
    return (config["num_hidden_layers"] * layer + 2 * vocab * h + h) * elem_bytes


def decode_traffic_bytes(config: dict, num: int, prompt: int, new: int) -> int:
    """Lower bound of the bytes ``num`` requests of ``prompt`` tokens move while decoding
    ``new`` tokens each: every step reads all weights once and every running request's KV
    (prefill and sampling counted as free)."""
    kv = num * sum(prompt + t for t in range(new)) * kv_bytes_per_token(config)
    return new * weight_bytes(config) + kv


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ConfigError for an unknown name."""
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def build_model(preset_or_config: str | dict, out_dir: str, *, seed: int = 0,
                dtype: str = "float32", device: str = "cpu", save_weights: bool = True,
                num_layers: int | None = None) -> str:
    """Write ``config.json`` (+ ``model.safetensors``) of a random Llama to ``out_dir``.

    Parameters
    ----------
    preset_or_config
        A name from :data:`PRESETS` or a dict of ``LlamaConfig`` fields.
    out_dir
        Created if missing; an existing model with the same config and seed is reused.
    seed
        Seed of the weight init (same seed and device -> same weights).
    dtype
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: dtype of the weights.
    device
        Where to run the init (``"cuda"`` makes an 8B-shaped init take seconds).
    save_weights
        ``False`` writes only the config and a stamp: loaders then call :func:`instantiate`, which
        builds the same seeded weights directly on their device (no multi-GB file written or read).
    num_layers
        Overrides ``num_hidden_layers`` (e.g. an 8-layer Llama-3-8B shape).

    Returns
    -------
    str
        ``out_dir``.
    """
    try:
        from transformers import LlamaConfig
    except ImportError as exc:
        raise UnsupportedError(f"building a model needs transformers: {exc}") from exc
    fields = _fields(preset_or_config)
    if num_layers is not None:
        fields["num_hidden_layers"] = int(num_layers)
    meta = {"fields": fields, "seed": seed, "dtype": dtype, "init": "normal_(0, 0.02) v2",
            "weights": "safetensors" if save_weights else "instantiate"}
    stamp = json.dumps(meta, sort_keys=True)
    stamp_path = os.path.join(out_dir, STAMP)
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    config = LlamaConfig(**fields, initializer_range=0.02, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if save_weights:
        from safetensors.torch import save_file
        model = instantiate(out_dir, device=device, dtype=dtype, seed=seed)
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return out_dir


def instantiate(model_dir: str, *, device: str, dtype: str, seed: int | None = None,
                attn_implementation: str = "paged|sdpa"):
    """Build the random ``LlamaForCausalLM`` of ``model_dir`` in place on ``device`` (no file read).

    The weights are drawn on ``device`` in ``dtype`` (``seed`` defaults to the stamp's), so two
    calls give the same model; a saved ``model.safetensors`` holds exactly these weights.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    if seed is None:
        with open(os.path.join(model_dir, STAMP)) as f:
            seed = json.load(f)["seed"]
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch_dtype(dtype),
                                              attn_implementation=attn_implementation)
    _init_weights(model, seed=seed)
    return model.eval()


def saved_weights(model_dir: str) -> bool:
    """Whether ``model_dir`` holds weights on disk (else load it with :func:`instantiate`)."""
    return os.path.exists(os.path.join(model_dir, "model.safetensors"))


def _fields(preset_or_config) -> dict:
    if isinstance(preset_or_config, dict):
        return dict(preset_or_config)
    if preset_or_config not in PRESETS:
        raise ConfigError(f"unknown model preset {preset_or_config!r}: expected one of {sorted(PRESETS)} "
                          "or a dict of LlamaConfig fields")
    return dict(PRESETS[preset_or_config])


@torch.no_grad()
def _init_weights(model, *, seed: int) -> None:
    """Normal(0, 0.02) on every matrix, ones on norms, in place, whatever the library's init did."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)  # weights depend on the init device
    for _, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def model_shape(model_dir: str) -> ModelShape:
    """Read the KV shape of a model directory's ``config.json``."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return ModelShape(num_layers=cfg["num_hidden_layers"],
                      num_kv_heads=cfg.get("num_key_value_heads", heads),
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      vocab_size=cfg["vocab_size"], max_position=cfg["max_position_embeddings"])


def random_prompts(num: int, lengths: int | list[int], *, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of random token ids in ``[1, vocab_size)`` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [lengths] * num if isinstance(lengths, int) else list(lengths)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lens]


def check_not_degenerate(token_ids: list[list[int]], *, min_distinct_openings: float = 0.5,
                         min_distinct_tokens: int = 3) -> dict:
    """Check outputs vary across prompts and positions.

    Parameters
    ----------
    token_ids
        Generated ids per prompt.
    min_distinct_openings
        Fraction of prompts whose first 4 generated tokens must be distinct from each other.
    min_distinct_tokens
        Distinct tokens each output must contain on average (a 2-token cycle fails).

    Returns
    -------
    dict
        ``{"ok": bool, "distinct_openings": int, "mean_distinct_tokens": float, "reason": str}``.
    """
    outputs = [ids for ids in token_ids if ids]
    if not outputs:
        return {"ok": False, "distinct_openings": 0, "mean_distinct_tokens": 0.0, "reason": "no output"}
    openings = len({tuple(ids[:4]) for ids in outputs})
    mean_distinct = sum(len(set(ids)) for ids in outputs) / len(outputs)
    need_open = max(1, int(min_distinct_openings * len(outputs))) if len(outputs) > 1 else 1
    reasons = []
    if openings < need_open:
        reasons.append(f"only {openings} distinct 4-token openings for {len(outputs)} prompts")
    longest = max(len(ids) for ids in outputs)
    if longest >= 2 * min_distinct_tokens and mean_distinct < min_distinct_tokens:
        reasons.append(f"outputs hold {mean_distinct:.1f} distinct tokens on average (a cycle)")
    return {"ok": not reasons, "distinct_openings": openings,
            "mean_distinct_tokens": round(mean_distinct, 2), "reason": "; ".join(reasons)}
