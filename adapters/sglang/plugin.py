"""SGLang plugin entry point (group ``sglang.srt.plugins``): registers ``--attention-backend vattn``.

pyproject::

    [project.entry-points."sglang.srt.plugins"]
    vattn = "vattn.adapters.sglang.plugin:register"

The backend needs vattn's KV pool inside SGLang's ``ModelRunner``, which the vattn *platform*
(:mod:`.platform`, group ``sglang.srt.platforms``, opt-in with ``VATTN_SGLANG=1``) installs.
"""

from __future__ import annotations

from vattn.core.errors import ConfigError

from .version import check_version

BACKEND_NAME = "vattn"


def register() -> None:
    """Check the SGLang version, then register the ``vattn`` attention backend and CLI choice."""
    check_version()
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_vattn_backend)


def create_vattn_backend(runner):
    """Backend factory SGLang calls with its ``ModelRunner``.

    Raises
    ------
    ConfigError
        Unsupported server args, SGLang's own KV pool (``VATTN_SGLANG=1`` not set), or a vattn
        cache too small for SGLang's ``ReqToTokenPool``.
    """
    check_server_args(runner.server_args)
    pool = runner.token_to_kv_pool
    if not hasattr(pool, "vattn_cache"):
        raise ConfigError(f"--attention-backend {BACKEND_NAME} needs vattn's KV pool, but SGLang "
                          f"built {type(pool).__name__}: set VATTN_SGLANG=1 (the vattn platform) "
                          "before SGLang starts")
    from .backend import VattnAttnBackend
    from .sizing import check_fit

    check_fit(pool, runner.req_to_token_pool)
    return VattnAttnBackend(runner)


def prefill_graph_backend(server_args) -> str | None:
    """SGLang's resolved prefill CUDA-graph backend (``"disabled"``, ``"breakable"``, ...), or
    ``None`` where the server args carry no resolved ``cuda_graph_config``."""
    prefill = getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None)
    return getattr(prefill, "backend", None)


def check_server_args(server_args) -> None:
    """Refuse settings the adapter does not support (page size 1, prefill CUDA graphs, the
    hierarchical cache). The radix cache is supported (SGLang's default): one SGLang page is one
    vattn page-set, and a cached page is shared by mapping it into each request's region.

    ``page_size > 1`` routes SGLang's scheduler through the paged allocator (page ids, which vattn
    binds to page-sets); its value must be the tokens of one page-set (checked by the pool).
    Prefill CUDA graphs (SGLang's default ``breakable`` one on CUDA) run the attention once at
    capture on a dummy batch that names requests no allocation has mapped pages for: on the GPU
    that read faults (seen on the H200 as ``CUBLAS_STATUS_EXECUTION_FAILED`` in the next GEMM).
    """
    backend = prefill_graph_backend(server_args)
    on_cuda = getattr(server_args, "device", None) in (None, "cuda")   # no graph runner elsewhere
    if on_cuda and backend not in (None, "disabled"):
        raise ConfigError(f"--attention-backend {BACKEND_NAME} does not support prefill CUDA "
                          f"graphs yet (got the {backend!r} prefill graph): pass "
                          "--disable-prefill-cuda-graph (decode CUDA graphs are supported)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ConfigError("--attention-backend vattn does not support --enable-hierarchical-cache "
                          "(host-memory KV tiers copy KV by index); the radix cache itself is "
                          "supported")
    page_size = getattr(server_args, "page_size", 1) or 1
    if page_size < 2:
        raise ConfigError(f"--attention-backend vattn needs --page-size > 1 (the tokens of one "
                          f"vattn page-set; leave it unset and the vattn platform picks it), got "
                          f"{page_size}")
