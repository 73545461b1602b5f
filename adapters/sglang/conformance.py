"""``vattn conformance --engine sglang``: the SGLang runner of the conformance harness.

Not runnable yet, for two precise reasons (raised as :class:`UnsupportedError`):

* CPU: SGLang 0.5.17 runs an engine on the CPU only with ``SGLANG_USE_CPU_ENGINE=1``, which makes
  its modules import ``sgl_kernel``'s CPU ops at import time (e.g. ``mem_cache.allocation``
  imports ``assign_req_to_token_pool_cpu``); that CPU build of ``sgl_kernel`` is not on PyPI
  (the ``sglang-kernel`` wheel there is the CUDA build). Without the flag the engine takes the
  CUDA path. The pool, allocator and backend are checked on CPU through SGLang's own classes
  instead (``tests/adapters/sglang``: bit-identical to ``torch_native``).
* GPU: installing the vattn pool/allocator inside SGLang's ``ModelRunner`` needs its
  out-of-tree platform hooks (``get_mha_kv_pool_cls`` / ``get_paged_allocator_cls``), not
  written yet; ``tools/gpu/sglang.sh`` stages SGLang 0.5.17 for that run.
"""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

from .version import check_version

WHY = ("the SGLang end-to-end runner cannot run yet: on CPU, SGLang 0.5.17's engine needs "
       "sgl_kernel's CPU build (SGLANG_USE_CPU_ENGINE=1), which is not on PyPI; on CUDA the "
       "vattn pool/allocator are not yet installed into ModelRunner (out-of-tree platform "
       "hooks). Module-level identity vs torch_native: pytest tests/adapters/sglang")


class SglangRunner:
    """Would run SGLang stock (``torch_native`` / ``fa3``) vs ``--attention-backend vattn``."""

    name = "sglang"
    modes = ("stock", "vattn")

    def run(self, mode, model_dir, prompts, max_new_tokens, *, logprobs=5, device="cpu",
            dtype="float32", arrival_times=None):
        """Raise :class:`UnsupportedError` (see the module docstring) after the version gate."""
        check_version()
        if mode not in self.modes:
            raise UnsupportedError(f"sglang runner mode must be one of {self.modes}, got {mode!r}")
        raise UnsupportedError(WHY)
