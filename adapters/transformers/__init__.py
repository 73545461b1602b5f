"""vattn for Hugging Face transformers continuous batching (``generate_batch``, ``transformers serve``).

Example
-------
>>> import vattn.adapters.transformers as vt
>>> vt.enable(model, group_size=1)            # or load with attn_implementation="paged|vattn" after register()
>>> out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)

Supported: transformers 5.17.x (UnsupportedError otherwise), full-attention models.
"""

from __future__ import annotations

from vattn.core.errors import ConfigError

from .version import SUPPORTED, check_version

__all__ = ["enable", "disable", "register", "ATTN_NAME", "SUPPORTED", "check_version"]

ATTN_NAME = "paged|vattn"
_OPTIONS = ("group_size", "page_budget", "map_ahead_tokens", "scrub", "max_slots", "max_context",
            "prefill_backend", "decode_backend")


def register() -> None:
    """Register ``paged|vattn`` with ``AttentionInterface`` and install the cache injection."""
    check_version()
    from transformers import AttentionInterface

    from . import patches
    from .attention import vattn_paged_attention

    AttentionInterface.register(ATTN_NAME, vattn_paged_attention)
    patches.install()


def enable(model, **options) -> None:
    """Make ``model``'s continuous batching keep its KV in a vattn ``VirtualKVCache``.

    Parameters
    ----------
    model
        A loaded ``PreTrainedModel`` (full attention).
    **options
        Keyword-only cache options: ``group_size`` (int), ``page_budget`` (bytes or fraction),
        ``map_ahead_tokens`` (int), ``scrub`` (str), ``max_slots`` (int), ``max_context`` (int, caps the
        tokens per slot), ``prefill_backend`` /
        ``decode_backend`` (a ``vattn.core.ops.BACKENDS`` name or ``"auto"``: ``"reference"`` on CPU,
        the fastest installed on CUDA).

    Raises
    ------
    UnsupportedError
        transformers outside the tested range, or an op backend that cannot run here.
    ConfigError
        An unknown option, or a manager already cached on the model.
    """
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown vattn option(s) {sorted(unknown)}: expected some of {list(_OPTIONS)}")
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise ConfigError("the model already has a continuous batching manager; call "
                          "model.destroy_cached_continuous_batching_manager() first")
    register()
    config = model.config.get_text_config()
    _check_backends(model, config, options)
    config.vattn_options = dict(options)
    model.set_attn_implementation(ATTN_NAME)


def _check_backends(model, config, options: dict) -> None:
    """Fail at ``enable`` (not inside the generation thread) on a backend that cannot run here."""
    from .cache import resolve_backends
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    resolve_backends(model.device, model.dtype, head_dim, prefill=options.get("prefill_backend", "auto"),
                     decode=options.get("decode_backend", "auto"))


def disable(model) -> None:
    """Switch ``model`` back to ``paged|sdpa`` (the injection stays; it is inert for other names)."""
    model.set_attn_implementation("paged|sdpa")
