"""Drive TGI's real server in-process: load a local Llama, then Warmup / Prefill / Decode /
FilterBatch / ClearCache through TGI's own ``TextGenerationService`` (what its gRPC server
calls), acting as the router would. No network, no Hub: weights come from a local directory,
the tokenizer is a word-level one built here (token ``i`` is the word ``t{i}``).

Started by :class:`vattn.conformance.runners.tgi.TgiRunner` in a fresh interpreter (the vattn
hook must precede TGI's imports): ``python -m vattn.conformance.workers.tgi IN.json OUT.json``;
TGI's CUDA-only kernels are replaced by the CPU stand-ins of :mod:`.tgi_cpu`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from . import main as _main

__all__ = ["local_tokenizer_class", "load_model", "generate", "run", "main"]


def local_tokenizer_class(vocab_size: int):
    """A ``tokenizer_class`` for ``FlashCausalLM`` whose ``from_pretrained`` builds a word-level
    tokenizer of ``vocab_size`` words ``t0 .. t{n-1}`` (no special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class LocalTokenizer:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")
    return LocalTokenizer


def load_model(model_dir: str, *, dtype: str = "float32"):
    """TGI's ``FlashCausalLM`` with its ``FlashLlamaForCausalLM`` on ``model_dir``."""
    import torch
    from text_generation_server.models.custom_modeling.flash_llama_modeling import FlashLlamaForCausalLM
    from text_generation_server.models.flash_causal_lm import FlashCausalLM
    from text_generation_server.utils.speculate import set_speculate

    set_speculate(0)                                        # what get_model does without --speculate
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return FlashCausalLM(model_id=model_dir, model_class=FlashLlamaForCausalLM,
                         dtype=getattr(torch, dtype), tokenizer_class=local_tokenizer_class(vocab),
                         lora_adapter_ids=[])


def _request(pb, rid: int, ids: list[int], max_new_tokens: int, top_n: int, blocks=()):
    from text_generation_server.models.globals import BLOCK_SIZE
    params = pb.NextTokenChooserParameters(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0,
                                           do_sample=False, seed=0, repetition_penalty=1.0,
                                           frequency_penalty=0.0, watermark=False)
    text = " ".join(f"t{i}" for i in ids)
    slots = [s for b in blocks for s in range(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)]
    return pb.Request(id=rid, inputs=text, input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
                      truncate=len(ids), parameters=params, top_n_tokens=top_n,
                      stopping_parameters=pb.StoppingCriteriaParameters(
                          max_new_tokens=max_new_tokens, ignore_eos_token=True),
                      blocks=list(blocks), slots=slots, add_special_tokens=False)


async def _generate(model, prompts, max_new_tokens, top_n, arrival_times):
    from text_generation_server.cache import Cache
    from text_generation_server.models.globals import BLOCK_SIZE, set_adapter_to_index
    from text_generation_server.pb import generate_pb2 as pb
    from text_generation_server.server import TextGenerationService

    set_adapter_to_index({})                                # what serve() does without LoRA adapters
    svc = TextGenerationService(model, Cache(), server_urls=[])
    longest = max(len(p) for p in prompts) + max_new_tokens
    warm = [_request(pb, 10_000 + i, p, max_new_tokens, top_n) for i, p in enumerate(prompts)]
    await svc.Warmup(pb.WarmupRequest(batch=pb.Batch(id=0, requests=warm, size=len(warm)),
                                      max_input_tokens=longest - 1, max_total_tokens=longest,
                                      max_prefill_tokens=sum(map(len, prompts))), None)
    per_req = -(-(longest - 1) // BLOCK_SIZE)
    free = list(range(per_req * len(prompts), 0, -1))       # router-style block ids; 0 stays free
    arrival = list(arrival_times or [0.0] * len(prompts))
    out = {i: {"ids": [], "lp": []} for i in range(len(prompts))}
    stats = {"prefills": 0, "prefills_with_running_batch": 0, "decodes": 0, "filters": 0}
    waiting, cached, next_id, start = list(range(len(prompts))), None, 1, time.perf_counter()
    while waiting or cached is not None:
        now = time.perf_counter() - start
        ready = [i for i in waiting if arrival[i] <= now]
        if not ready and cached is None:
            await asyncio.sleep(min(arrival[i] for i in waiting) - now)
            continue
        if ready:
            waiting = [i for i in waiting if i not in ready]
            reqs = [_request(pb, i, prompts[i], max_new_tokens, top_n,
                             blocks=[free.pop() for _ in range(per_req)]) for i in ready]
            msg = pb.PrefillRequest(batch=pb.Batch(id=next_id, requests=reqs, size=len(reqs)))
            if cached is not None:
                msg.cached_batch.CopyFrom(cached)
                stats["prefills_with_running_batch"] += 1
            resp, next_id = await svc.Prefill(msg, None), next_id + 1
            stats["prefills"] += 1
        else:
            resp = await svc.Decode(pb.DecodeRequest(batches=[cached]), None)
            stats["decodes"] += 1
        cached = await _collect(svc, pb, resp, out, top_n, stats)
    seconds = time.perf_counter() - start
    await svc.ClearCache(pb.ClearCacheRequest(), None)
    return [out[i] for i in range(len(prompts))], seconds, stats


async def _collect(svc, pb, resp, out, top_n, stats):
    """Record generated tokens; filter finished requests out, as the router does."""
    done = set()
    for g in resp.generations:
        for tid, lp in zip(g.tokens.ids, g.tokens.logprobs):
            top = dict(zip(g.top_tokens[0].ids, g.top_tokens[0].logprobs)) if top_n else {}
            top[tid] = lp
            out[g.request_id]["ids"].append(tid)
            out[g.request_id]["lp"].append(top)
        if g.HasField("generated_text"):
            done.add(g.request_id)
    if not resp.HasField("batch"):
        return None
    keep = [r for r in resp.batch.request_ids if r not in done]
    if not keep:
        await svc.ClearCache(pb.ClearCacheRequest(id=resp.batch.id), None)
        return None
    if len(keep) < len(resp.batch.request_ids):
        stats["filters"] += 1
        return (await svc.FilterBatch(pb.FilterBatchRequest(batch_id=resp.batch.id, request_ids=keep),
                                      None)).batch
    return resp.batch


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, top_n: int = 5,
             arrival_times: list[float] | None = None):
    """Greedy generation of ``max_new_tokens`` per prompt (EOS ignored) through TGI's service.

    Prompts are admitted when their arrival time (seconds after warmup) has passed: those that
    arrive while a batch runs are prefilled together with it (TGI's ``Prefill`` with a
    ``cached_batch``, i.e. ``concatenate``); finished requests are filtered out as the router does.

    Returns
    -------
    (list[dict], float, dict)
        Per prompt ``{"ids": [...], "lp": [{token: logprob}, ...]}`` (top ``top_n`` plus the
        chosen token), seconds after warmup, and counts of the service calls made.
    """
    return asyncio.run(_generate(model, prompts, max_new_tokens, top_n, arrival_times))


def run(job: dict) -> dict:
    """``job``: ``model_dir, prompts, max_new_tokens, top_n, dtype, arrival_times``; the
    environment carries TGI's and vattn's settings (``VATTN_TGI=1`` and the rest). Returns
    :class:`~vattn.conformance.protocol.RunResult` fields."""
    from vattn.adapters.tgi import activate

    from . import tgi_cpu
    patcher = activate.install_from_env()
    if patcher is None:
        raise SystemExit("the TGI worker needs VATTN_TGI=1: TGI's own attention does not run here")
    standins = tgi_cpu.apply()
    model = load_model(job["model_dir"], dtype=job.get("dtype", "float32"))
    top_n = job.get("top_n", 5)
    outs, seconds, calls = generate(model, job["prompts"], job["max_new_tokens"], top_n=top_n,
                                    arrival_times=job.get("arrival_times"))
    ids = [o["ids"] for o in outs]
    return dict(token_ids=ids, logprobs=[o["lp"] for o in outs] if top_n else None, seconds=seconds,
                num_prompt_tokens=sum(map(len, job["prompts"])), num_generated_tokens=sum(map(len, ids)),
                extra={"applied": sorted(patcher.applied), "cpu_standins": standins, "calls": calls,
                       "bound_after_run": len(patcher.runtime.slot_of),
                       "cache": patcher.runtime.cache.metrics()})


def main(argv: list[str] | None = None) -> int:
    return _main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
