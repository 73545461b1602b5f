"""``vattn conformance --engine tgi``: TGI v3.3.7's real server with vattn vs a reference.

Modes
-----
``"reference"`` (the baseline)
    Hugging Face transformers' ``LlamaForCausalLM`` on the same weights, greedy, one prompt at
    a time. TGI's *own* paged path cannot be the baseline on CPU: its attention package refuses
    a plain CPU and its CUDA kernels come from the Hub (see
    :mod:`vattn.conformance.workers.tgi_cpu` for every stop).
``"vattn"``
    TGI's real ``TextGenerationService`` / ``FlashCausalLM`` / ``FlashLlamaForCausalLM`` with
    vattn's cache and attention, driven in a fresh interpreter by
    :mod:`vattn.conformance.workers.tgi` (the hook must precede TGI's imports), with
    :mod:`~vattn.conformance.workers.tgi_cpu`'s stand-ins for TGI's CUDA-only kernels.

Only ``device="cpu"`` runs; on CUDA the runner raises ``UnsupportedError`` (TGI's CUDA path
needs its Hub kernels, which this project cannot fetch; not wired or tested).
"""

from __future__ import annotations

import os
import time

from vattn.adapters.tgi.version import check_server
from vattn.core.errors import UnsupportedError

from .process import run_worker

__all__ = ["TgiRunner", "vattn_env", "WORKER"]

#: the worker a vattn run's server process runs
WORKER = "vattn.conformance.workers.tgi"


def vattn_env(num_prompts: int, max_context: int, *, num_layers: int, kv_heads: int, head_dim: int,
              dtype_bytes: int, page_bytes: int = 1 << 16, options: dict | None = None) -> dict:
    """Server environment for a run: TGI's settings plus ``VATTN_TGI_*`` sizes.

    ``CUDA_GRAPHS`` is left unset (what TGI's launcher does for ``--cuda-graphs 0``).

    The page budget holds every request at ``max_context`` (one page-set of rounding per slot
    and the padding slot included). ``options`` overrides, e.g. ``{"group_size": 2}``.
    """
    token_bytes = 2 * kv_heads * head_dim * dtype_bytes           # one layer, K and V
    pages = -(-max_context * token_bytes // page_bytes) + 1
    env = {"VATTN_TGI": "1", "ATTENTION": "flashdecoding", "PREFIX_CACHING": "0",
           "VATTN_TGI_MAX_SLOTS": num_prompts, "VATTN_TGI_MAX_CONTEXT": max_context,
           "VATTN_TGI_PAGE_BYTES": page_bytes,
           "VATTN_TGI_PAGE_BUDGET": (num_prompts + 2) * num_layers * pages * page_bytes}
    for key, value in (options or {}).items():
        env[f"VATTN_TGI_{key.upper()}"] = value
    return {k: str(v) for k, v in env.items()}


class TgiRunner:
    """Conformance runner for TGI (see the module docstring for the modes)."""

    name = "tgi"
    modes = ("reference", "vattn")

    def __init__(self, *, vattn_options: dict | None = None, timeout_s: float = 1800.0):
        self.vattn_options = dict(vattn_options or {})
        self.timeout_s = timeout_s

    def run(self, mode, model_dir, prompts, max_new_tokens, *, logprobs=5, device="cpu",
            dtype="float32", arrival_times=None):
        """See ``vattn.conformance.protocol``.

        Raises
        ------
        UnsupportedError
            Unknown mode, a CUDA device, or no TGI server v3.3.7 importable here.
        VattnError
            The TGI run failed (its output tail is in the message).
        """
        if mode not in self.modes:
            raise UnsupportedError(f"mode must be one of {self.modes}, got {mode!r}")
        if not str(device).startswith("cpu"):
            raise UnsupportedError("the TGI runner runs on CPU only: TGI's CUDA path needs its Hub "
                                   "kernels (paged-attention, rotary, layer norm), not wired here")
        check_server()
        if mode == "reference":
            return _reference(model_dir, prompts, max_new_tokens, logprobs=logprobs, dtype=dtype,
                              arrival_times=arrival_times)
        return self._vattn(model_dir, prompts, max_new_tokens, logprobs, dtype, arrival_times)

    def _vattn(self, model_dir, prompts, max_new_tokens, logprobs, dtype, arrival_times):
        from vattn.conformance.models import model_shape, torch_dtype
        shape = model_shape(model_dir)
        ctx = max(len(p) for p in prompts) + max_new_tokens + 1
        env = {k: v for k, v in os.environ.items()          # CUDA_GRAPHS unset = off, as the
               if not k.startswith("VATTN_") and k != "CUDA_GRAPHS"}  # launcher does for 0
        env.update(vattn_env(len(prompts), ctx, num_layers=shape.num_layers, kv_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim, dtype_bytes=torch_dtype(dtype).itemsize,
                             options=self.vattn_options))
        job = {"model_dir": model_dir, "prompts": prompts, "max_new_tokens": max_new_tokens,
               "top_n": logprobs, "dtype": dtype, "arrival_times": arrival_times}
        result = run_worker(WORKER, job, env=env, timeout_s=self.timeout_s, what="TGI vattn")
        result.extra = {"tgi_server": check_server(), **result.extra}
        return result


def _reference(model_dir, prompts, max_new_tokens, *, logprobs, dtype, arrival_times=None):
    """Greedy transformers ``LlamaForCausalLM`` on ``model_dir``, one prompt at a time (each
    started no earlier than its arrival time)."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError as exc:
        raise UnsupportedError(f"the TGI reference mode needs transformers: {exc}") from exc
    from vattn.conformance.models import torch_dtype
    model = LlamaForCausalLM.from_pretrained(model_dir).to(torch_dtype(dtype)).eval()
    ids_out, lps_out, start = [], [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        if arrival_times:
            time.sleep(max(0.0, arrival_times[i] - (time.perf_counter() - start)))
        new, steps = _greedy(model, prompt, max_new_tokens, logprobs)
        ids_out.append(new)
        lps_out.append(steps)
    seconds = time.perf_counter() - start
    return _result(ids_out, lps_out if logprobs else None, seconds, prompts, {"engine": "transformers"})


def _greedy(model, prompt, max_new_tokens, top_k):
    """``(new token ids, [{token: logprob} of the top ``top_k`` plus the chosen one per step])``."""
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    new, steps = out.sequences[0, len(prompt):].tolist(), []
    for tok, logits in zip(new, out.logits):
        lp = torch.log_softmax(logits[0].float(), -1)
        top = lp.topk(max(top_k, 1))
        step = dict(zip(top.indices.tolist(), top.values.tolist()))
        step[tok] = float(lp[tok])
        steps.append(step)
    return new, steps


def _result(ids, lps, seconds, prompts, extra):
    from vattn.conformance.protocol import RunResult
    return RunResult(token_ids=ids, logprobs=lps, seconds=seconds,
                     num_prompt_tokens=sum(len(p) for p in prompts),
                     num_generated_tokens=sum(len(x) for x in ids), extra=extra)
