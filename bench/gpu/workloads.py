"""The workloads and model shapes of the GPU stages, one definition for every engine."""

from __future__ import annotations

import json
import os

from vattn.conformance.models import PRESETS, build_model, random_prompts

__all__ = ["WORKLOADS", "SHARED_PREFIX", "MULTI_TURN_USER", "LLAMA3_8B_LONG", "SHAPES", "IDENTITY_MODELS",
           "workload_prompts", "env_shape", "llama_model"]

#: name -> (num prompts, prompt length, new tokens); every request of a workload runs at once
#: (``max_num_seqs`` = the number of prompts where a stage sizes the engine)
WORKLOADS = {"decode-heavy": (256, 512, 512), "prefill-heavy": (32, 16384, 64),
             "long-context": (8, 65536, 64), "shared-prefix": (128, 4096 + 256, 128),
             "multi-turn": (128, 1024, 256), "decode-light": (64, 1024, 256)}
#: ``decode-light``: the batch a server at moderate load decodes (about 55 requests ran at once in
#: the H100 `vllm serve` run at 40 req/s, 1,024 in / 256 out), where host time per step weighs most
#: ``shared-prefix``: every prompt is one 4,096-token system prompt + 256 tokens of its own
SHARED_PREFIX = 4096
#: ``multi-turn``: each round is the next turn of 128 conversations (vLLM's paired stage): the
#: last prompt + the engine's own reply + ``MULTI_TURN_USER`` new user tokens
MULTI_TURN_USER = 256
#: the Llama-3-8B shape with 131,072 positions (vLLM's stages: its own sizing takes the model's)
LLAMA3_8B_LONG = dict(PRESETS["llama3-8b-shape"], max_position_embeddings=131072)
#: the model shapes one run puts through every engine (``vattn compare --shape``): the Llama-3-8B
#: shape with 131,072 positions (as vLLM's stages: the engines' own sizing takes the model's, and
#: ``long-context`` needs more than the preset's 33,792) and the 1B-class one
SHAPES = {"llama3-8b-shape": LLAMA3_8B_LONG, "llama-1b-shape": PRESETS["llama-1b-shape"]}
#: per engine, the random-weight model of its identity stage (std 0.02, bf16)
IDENTITY_MODELS = {
    # 8 of Llama-3-8B's layers, its attention shapes
    "vllm": dict(LLAMA3_8B_LONG, num_hidden_layers=8, intermediate_size=4096, vocab_size=32000,
                 max_position_embeddings=8192),
    # 4 layers, hidden 2048, 16 q / 8 kv heads, d=128
    "sglang": dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, intermediate_size=4096, vocab_size=32000,
                   max_position_embeddings=4096),
}


def workload_prompts(name: str, vocab_size: int, *, seed: int) -> list[list[int]]:
    """The prompts of workload ``name`` (:data:`WORKLOADS`), random token ids, seeded;
    ``shared-prefix`` prompts start with one shared :data:`SHARED_PREFIX`-token prompt."""
    num, length, _ = WORKLOADS[name]
    if name == "shared-prefix":
        (shared,) = random_prompts(1, SHARED_PREFIX, vocab_size=vocab_size, seed=11)
        own = random_prompts(num, length - SHARED_PREFIX, vocab_size=vocab_size, seed=seed)
        return [shared + p for p in own]
    return random_prompts(num, length, vocab_size=vocab_size, seed=seed)


def env_shape(overrides: dict | None = None) -> tuple[str, dict]:
    """``VATTN_SHAPE`` (default ``llama3-8b-shape``; also ``llama-1b-shape``): the preset's name
    and its config fields, or ``overrides[name]`` where given."""
    name = os.environ.get("VATTN_SHAPE", "llama3-8b-shape")
    if name in (overrides or {}):
        return name, overrides[name]
    if name not in PRESETS:
        raise SystemExit(f"VATTN_SHAPE must be one of {sorted(PRESETS)}, got {name!r}")
    return name, PRESETS[name]


def llama_model(path: str, fields: dict, *, weights: bool = False, seed: int = 0) -> str:
    """A ``LlamaForCausalLM`` folder vLLM and SGLang load: ``config.json`` (``architectures``
    set: SGLang picks the model class from it) and, with ``weights``, seeded random bf16 weights
    built on the GPU (:func:`~vattn.conformance.models.build_model`); without, the engines load
    it with ``load_format="dummy"`` (an engine that builds its model in-process draws the
    ``seed``'s weights on its device: :func:`~vattn.conformance.models.instantiate`)."""
    build_model(fields, path, seed=seed, dtype="bfloat16", device="cuda" if weights else "cpu",
                save_weights=weights)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if not cfg.get("architectures"):
        cfg["architectures"] = ["LlamaForCausalLM"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return path
