"""Conformance runner: transformers continuous batching, ``paged|sdpa`` (stock) vs ``paged|vattn``."""

from __future__ import annotations

import time

import torch

from vattn.adapters.transformers.version import check_version
from vattn.conformance.protocol import RunResult
from vattn.core.errors import ConfigError

__all__ = ["TransformersRunner"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersRunner:
    """Runs ``generate_batch`` greedily on the stock paged cache and on vattn.

    Parameters
    ----------
    block_size, num_blocks, max_batch_tokens
        Continuous-batching sizing (explicit: the default sizing is very slow on CPU).
        ``num_blocks=None`` sizes the pool from the prompts.
    vattn_options
        Passed to :func:`vattn.adapters.transformers.enable`.
    """

    name = "transformers"
    modes = ("stock", "vattn")

    def __init__(self, *, block_size: int = 32, num_blocks: int | None = None,
                 max_batch_tokens: int = 512, use_cuda_graph: bool | None = None,
                 vattn_options: dict | None = None):
        check_version()
        self.block_size, self.num_blocks, self.max_batch_tokens = block_size, num_blocks, max_batch_tokens
        self.use_cuda_graph = use_cuda_graph
        self.vattn_options = dict(vattn_options or {})
        self._model, self._model_key = None, None  # loaded once, modes switched in place

    def run(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
            logprobs: int = 5, device: str = "cpu", dtype: str = "float32",
            arrival_times: list[float] | None = None) -> RunResult:
        """See :class:`vattn.conformance.protocol.EngineRunner`; only the chosen token's log-prob is
        available from transformers' continuous batching (``logprobs`` > 0 asks for it)."""
        if mode not in self.modes:
            raise ConfigError(f"mode must be one of {self.modes}, got {mode!r}")
        from transformers import GenerationConfig
        model = self._load(mode, model_dir, device, dtype, prompts=prompts, max_new_tokens=max_new_tokens)
        gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        cb = self._cb_config(prompts, max_new_tokens, logprobs=logprobs > 0, device=device)
        if arrival_times is None:  # warm-up builds the manager and cache outside the timed region
            model.generate_batch(prompts[:2], generation_config=gen, continuous_batching_config=cb,
                                 progress_bar=False, warmup=False, persistent_manager=True)
        _sync(device)
        start = time.perf_counter()
        if arrival_times is None:
            outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                           progress_bar=False, warmup=False, persistent_manager=True)
            by_index = _order(outputs, prompts)
            metrics = _vattn_metrics(model)
            model.destroy_cached_continuous_batching_manager()
        else:
            by_index, metrics = _generate_arrivals(model, prompts, arrival_times, gen, cb)
        _sync(device)
        seconds = time.perf_counter() - start
        return _result(by_index, prompts, seconds, logprobs > 0, extra={"mode": mode,
                       "attn_implementation": model.config._attn_implementation, "vattn_metrics": metrics})

    def _load(self, mode: str, model_dir: str, device: str, dtype: str, *, prompts, max_new_tokens: int):
        from transformers import AutoModelForCausalLM

        from vattn.conformance.models import instantiate, saved_weights
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        key = (model_dir, str(device), dtype)
        if self._model_key != key:
            self._model = None
            if saved_weights(model_dir):
                self._model = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=_DTYPES[dtype], attn_implementation="paged|sdpa").to(device).eval()
            else:  # random weights drawn directly on the device: no multi-GB file written or read
                self._model = instantiate(model_dir, device=device, dtype=dtype)
            self._model_key = key
        model = self._model
        if getattr(model, "_cached_continuous_batching_manager", None) is not None:
            model.destroy_cached_continuous_batching_manager()
        if mode == "vattn":
            from vattn.adapters.transformers import enable
            enable(model, **self.enable_kwargs(prompts, max_new_tokens))
        else:
            model.set_attn_implementation("paged|sdpa")
        return model

    def enable_kwargs(self, prompts, max_new_tokens: int) -> dict:
        """What the vattn mode passes :func:`vattn.adapters.transformers.enable` (a slot per
        prompt, the longest request's context; ``vattn_options`` over them)."""
        longest = max(len(p) for p in prompts) + max_new_tokens
        return {"max_slots": len(prompts) + 1, "max_context": longest, **self.vattn_options}

    @torch.no_grad()
    def topk_logprobs(self, prompt: list[int], k: int = 5) -> dict[int, float]:
        """Top-``k`` next-token log-probs after ``prompt`` from one plain forward of the loaded model.

        transformers' continuous batching returns only the chosen token's log-prob; the identity
        check calls this at a divergence to judge it a near-tie (the prefix is the same on both
        sides there, so one distribution serves both).
        """
        if self._model is None:
            raise ConfigError("topk_logprobs needs a model: call run() first")
        model, impl = self._model, self._model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            ids = torch.tensor([prompt], device=model.device)
            logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        finally:
            model.set_attn_implementation(impl)
        values, tokens = torch.log_softmax(logits, -1).topk(k)
        return dict(zip(tokens.tolist(), values.tolist()))

    def cb_kwargs(self, prompts, max_new_tokens: int, *, logprobs: bool, device: str) -> dict:
        """The ``ContinuousBatchingConfig`` arguments of a run (both modes)."""
        num_blocks = self.num_blocks
        if num_blocks is None:  # room for every request at full length, plus one block each
            per = [-(-(len(p) + max_new_tokens) // self.block_size) + 1 for p in prompts]
            num_blocks = sum(per)
        return dict(
            block_size=self.block_size, num_blocks=num_blocks, max_batch_tokens=self.max_batch_tokens,
            # explicit: else the manager sizes itself from the 2-prompt warm-up and batches 2 at a time
            max_requests_per_batch=min(len(prompts), self.max_batch_tokens),
            allow_block_sharing=False, return_logprobs=logprobs,
            use_cuda_graph=False if not str(device).startswith("cuda") else self.use_cuda_graph)

    def _cb_config(self, prompts, max_new_tokens: int, *, logprobs: bool, device: str):
        from transformers import ContinuousBatchingConfig
        return ContinuousBatchingConfig(**self.cb_kwargs(prompts, max_new_tokens, logprobs=logprobs,
                                                         device=device))


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _order(outputs: dict, prompts: list[list[int]]) -> list:
    """Request ids ``req_<n>`` increase in submission order; return outputs by prompt index."""
    ordered = [out for _, out in sorted(outputs.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))]
    if len(ordered) != len(prompts):
        raise ConfigError(f"expected {len(prompts)} outputs, got {len(ordered)}")
    for i, (out, prompt) in enumerate(zip(ordered, prompts)):
        if list(out.prompt_ids) != list(prompt):
            raise ConfigError(f"output {out.request_id} does not belong to prompt {i}")
    return ordered


def _generate_arrivals(model, prompts, arrival_times, gen, cb) -> tuple[list, dict | None]:
    """Submit prompt ``i`` at ``arrival_times[i]`` seconds through the manager API; return the
    outputs by prompt index and the vattn metrics (``None`` on the stock path)."""
    if len(arrival_times) != len(prompts):
        raise ConfigError(f"arrival_times must have {len(prompts)} entries, got {len(arrival_times)}")
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        start = time.perf_counter()
        for i in sorted(range(len(prompts)), key=lambda j: arrival_times[j]):
            delay = arrival_times[i] - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            manager.add_request(prompts[i], request_id=f"req_{i}", max_new_tokens=gen.max_new_tokens)
        results = {}
        while len(results) < len(prompts):
            out = manager.get_result(timeout=60)
            if out is None:
                raise ConfigError(f"no result within 60 s ({len(results)}/{len(prompts)} done)")
            if out.is_finished():
                results[out.request_id] = out
        metrics = _vattn_metrics(model, manager)
    finally:
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager()
    return _order(results, prompts), metrics


def _vattn_metrics(model, manager=None) -> dict | None:
    """The vattn cache's metrics plus its layout row (``worst_waste_bytes``) of the model's
    continuous batching manager; ``None`` on the stock path."""
    manager = manager or getattr(model, "_cached_continuous_batching_manager", None)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if getattr(cache, "vattn", None) is None:
        return None
    from vattn.core.layout import cache_layout_row
    from vattn.core.metrics import jsonable
    found = cache.vattn_metrics() | {"layout": cache_layout_row(cache.vattn.config, cache.vattn.layout.page_bytes)}
    return jsonable(found)


def _result(outputs, prompts, seconds: float, with_logprobs: bool, *, extra: dict) -> RunResult:
    token_ids = [list(o.generated_tokens) for o in outputs]
    lps = None
    if with_logprobs:
        lps = [[{t: float(lp)} for t, lp in zip(o.generated_tokens, o.logprobs)] for o in outputs]
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise ConfigError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    return RunResult(token_ids=token_ids, logprobs=lps, seconds=seconds,
                     num_prompt_tokens=sum(len(p) for p in prompts),
                     num_generated_tokens=sum(len(t) for t in token_ids), extra=extra)
