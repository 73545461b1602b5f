"""``vattn conformance --engine tgi``: the runner for TGI's server (not end to end yet).

A TGI run needs its real server (``text_generation_server`` v3.3.7) and, for the flash model
files, TGI's CUDA kernels (``moe_kernels`` and the Hub ``paged-attention`` kernel): on a CPU
machine those files do not import, so no TGI generation can run there. This runner therefore
checks what it can and raises ``UnsupportedError`` with the reason; the end-to-end path
(driving ``FlashCausalLM.generate_token`` in-process with and without ``VATTN_TGI``) is the
missing piece listed in the README.
"""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

from .version import check_server

__all__ = ["TgiRunner"]


class TgiRunner:
    """Conformance runner for TGI; ``mode`` is ``"stock"`` or ``"vattn"``."""

    name = "tgi"

    def run(self, mode, model_dir, prompts, max_new_tokens, *, logprobs=5, device="cpu",
            dtype="float32", arrival_times=None):
        """See ``vattn.conformance.protocol``.

        Raises
        ------
        UnsupportedError
            Always for now: the server is missing or is not v3.3.7, or (with it present) the
            in-process end-to-end driver is not written yet.
        """
        if mode not in ("stock", "vattn"):
            raise UnsupportedError(f"mode must be 'stock' or 'vattn', got {mode!r}")
        check_server()
        if device == "cpu":
            raise UnsupportedError("TGI's flash models need CUDA kernels (moe_kernels, the Hub "
                                   "paged-attention kernel); they do not run on CPU")
        raise UnsupportedError("the end-to-end TGI conformance driver is not implemented yet")
