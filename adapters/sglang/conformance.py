"""``vattn conformance --engine sglang``: the SGLang runner of the conformance harness."""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

from .version import check_version


class SglangRunner:
    """Runs SGLang stock (``fa3``) vs ``--attention-backend vattn`` on the same prompts.

    Not wired yet: SGLang's ``Engine`` needs CUDA and ``sgl_kernel``, and the scheduler does not
    yet route allocation through :class:`~.allocator.VattnTokenAllocator` (see the report).
    """

    name = "sglang"
    modes = ("stock", "vattn")

    def run(self, mode, model_dir, prompts, max_new_tokens, *, logprobs=5, device="cpu",
            dtype="float32", arrival_times=None):
        check_version()
        if mode not in self.modes:
            raise UnsupportedError(f"sglang runner mode must be one of {self.modes}, got {mode!r}")
        raise UnsupportedError("the SGLang end-to-end runner is not implemented yet: the "
                               "pool, allocator and backend are tested at the module level only")
