"""A CPU stand-in for SGLang's scheduler loop over SGLang's own memory classes and vattn's pool.

Everything that decides memory is SGLang's: ``ReqToTokenPool``, ``RadixCache`` (or
``ChunkCache``), the allocation functions ``alloc_paged_token_slots_extend/decode``, the
``req_to_token`` writes of ``write_cache_indices``, ``cache_finished_req`` /
``cache_unfinished_req`` / ``evict`` and the lock references. The stand-in only plays the
scheduler: it matches and locks prefixes at admission, allocates, writes ``req_to_token``, runs
the vattn attention backend's forward with K/V that are a pure function of the token prefix (so
any request's cached copy of a token is bit-equal to a recomputed one), and checks after every
forward that each request's slot rows hold exactly its tokens' K/V.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from vattn.adapters.sglang.allocator import VattnTokenAllocator
from vattn.adapters.sglang.backend import VattnAttnBackend
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool, make_cache
from vattn.bench.radix import decode_slots, extend_slots, forward_batch

L, HQ, HK, D, PAGE = 2, 4, 2, 32, 16
#: bytes of one token in one range (K and V of one layer, fp32): a page-set of PAGE tokens
TOKEN_BYTES = 2 * HK * D * 4


def kv_of(tokens, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``tokens[position]`` in ``layer``: a function of the prefix up to it only."""
    digest = hashlib.blake2b(repr((tuple(tokens[:position + 1]), layer)).encode(), digest_size=8)
    gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
    kv = torch.randn(2, HK, D, generator=gen)
    return kv[0], kv[1]


_RIDS = iter(range(1 << 62))


def new_req(tokens) -> SimpleNamespace:
    """A request as SGLang's caches read it."""
    req = SimpleNamespace(rid=f"req-{next(_RIDS)}", origin_input_ids=list(tokens), output_ids=[],
                          req_pool_idx=None,
                          prefix_indices=torch.empty(0, dtype=torch.int64), last_node=None,
                          cache_protected_len=0, extra_key=None, inflight_middle_chunks=0,
                          kv_committed_len=0, priority=0)
    req.get_fill_ids = lambda: req.origin_input_ids + req.output_ids
    return req


class Engine:
    """SGLang's memory classes + vattn's pool / allocator / backend, driven step by step."""

    def __init__(self, *, reqs=6, ctx=128, page_sets=None, radix=True, map_ahead=0, rids=True,
                 defer_frees=False, graphs=False, driver=None, packs=False, defer_mapping=False):
        self.rids = rids              # False: forward batches without request ids (decode reads rows)
        page_sets = page_sets or reqs * -(-ctx // PAGE)
        self.cache = make_cache(num_layers=L, num_kv_heads=HK, head_dim=D, dtype=torch.float32,
                                max_requests=reqs + 2, max_context=ctx, device="cpu",
                                page_bytes=PAGE * TOKEN_BYTES, map_ahead_tokens=map_ahead,
                                page_budget=(page_sets + 2) * L * PAGE * TOKEN_BYTES, driver=driver,
                                pack_pages=16 * L if packs else 0, pack_sets=2)
        self.pool = VattnMHATokenToKVPool.from_cache(self.cache, page_size=PAGE)
        self.pool.requests.defer_mapping = defer_mapping   # VMM calls made layer by layer
        self.alloc = VattnTokenAllocator(page_sets * PAGE, PAGE, torch.float32, "cpu", self.pool)
        self.alloc.defer_frees = defer_frees    # as on the GPU: frees settled at the next alloc
        self.r2t = ReqToTokenPool(size=reqs, max_context_len=ctx, device="cpu",
                                  enable_memory_saver=False)
        if radix:
            self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                                   token_to_kv_pool_allocator=self.alloc,
                                                   page_size=PAGE))
        else:
            self.tree = ChunkCache(SimpleNamespace(req_to_token_pool=self.r2t, page_size=PAGE,
                                                   token_to_kv_pool_allocator=self.alloc))
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.r2t, token_to_kv_pool=self.pool)
        self.backend = VattnAttnBackend(runner, op_backend="reference" if graphs else "sdpa")
        self.graph_runner = None      # graphs: decode through the platform's CUDA-graph runner
        if graphs:
            from vattn.adapters.sglang.platform import graph_runner_cls
            self.backend.init_cuda_graph_state(max_bs=reqs, max_num_tokens=reqs)
            self.graph_runner = graph_runner_cls(GraphRunner)(SimpleNamespace(attn_backend=self.backend,
                                                                              max_bs=reqs))
        self.layers = [RadixAttention(HQ, D, D ** -0.5, HK, layer_id=i) for i in range(L)]

    # -- the scheduler's steps ---------------------------------------------------------------------
    def admit(self, reqs) -> list[int]:
        """Match + lock each request's prefix, allocate rows and pages, prefill. Returns the
        prefix lengths SGLang matched."""
        prefixes = []
        for req in reqs:
            if isinstance(self.tree, RadixCache):
                m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(req.get_fill_ids())))
                req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
                self.tree.inc_lock_ref(req.last_node)
            req.cache_protected_len = len(req.prefix_indices)
            prefixes.append(len(req.prefix_indices))
        self.r2t.alloc(reqs)
        self.extend(reqs, prefixes)
        return prefixes

    def extend(self, reqs, prefixes, upto=None) -> None:
        """Prefill ``prefixes[i] .. upto[i]`` (default: every filled token) of each request."""
        seqs = upto or [len(r.get_fill_ids()) for r in reqs]
        rows = [r.req_pool_idx for r in reqs]
        last = [int(self.r2t.req_to_token[r, p - 1]) if p else -1 for r, p in zip(rows, prefixes)]
        loc = extend_slots(self.tree, self.r2t, reqs, prefixes, seqs, last)
        self._forward(ForwardMode.EXTEND, reqs, prefixes, seqs, loc)

    def decode(self, reqs, token=7) -> None:
        """One new token for each request."""
        for req in reqs:
            req.output_ids.append(token + len(req.output_ids))
        seqs, loc = decode_slots(self.tree, self.r2t, reqs)
        self._forward(ForwardMode.DECODE, reqs, [s - 1 for s in seqs], seqs, loc)

    def unfinished(self, req) -> None:
        self.tree.cache_unfinished_req(req)

    def finish(self, req) -> None:
        self.tree.cache_finished_req(req, kv_len_to_handle=req.kv_committed_len)
        self.r2t.free(req)

    def retract(self, req) -> None:
        """SGLang's preemption: nothing inserted, only what the request owns is freed."""
        self.tree.cache_finished_req(req, is_insert=False, kv_len_to_handle=req.kv_committed_len)
        self.r2t.free(req)
        req.output_ids, req.prefix_indices, req.last_node = [], torch.empty(0, dtype=torch.int64), None

    def evict_all(self) -> None:
        if isinstance(self.tree, RadixCache):
            self.tree.evict(EvictParams(num_tokens=1 << 30))

    # -- forward and checks ------------------------------------------------------------------------
    def _forward(self, mode, reqs, prefixes, seqs, loc) -> None:
        fb = forward_batch(mode, reqs, prefixes, seqs, loc, rids=self.rids)
        if self.graph_runner is not None and mode.is_decode():
            fb = self.graph_runner.load_batch(fb)
        else:
            self.backend.init_forward_metadata(fb)
        for layer in self.layers:
            kv = [kv_of(r.get_fill_ids(), pos, layer.layer_id)
                  for r, p, s in zip(reqs, prefixes, seqs) for pos in range(p, s)]
            k = torch.stack([a for a, _ in kv])
            v = torch.stack([b for _, b in kv])
            pad = fb.batch_size - len(reqs)          # graph padding rows: stored on the pad slot
            if pad:
                k, v = (torch.cat([x, torch.zeros(pad, *x.shape[1:])]) for x in (k, v))
            q = torch.ones(k.shape[0], HQ * D)
            fwd = self.backend.forward_extend if mode.is_extend() else self.backend.forward_decode
            fwd(q, k, v, layer, fb)
        assert not self.cache.calls_queued, "a forward left deferred VMM calls unmade"
        self.check(reqs, seqs)

    def slot_of(self, req) -> int:
        return int(self.pool.requests.slot_of[req.req_pool_idx])

    def check(self, reqs, seqs=None) -> None:
        """Each request's slot rows ``0 .. seq - 1`` hold exactly its tokens' K/V."""
        c = self.pool.rows_per_slot
        for i, req in enumerate(reqs):
            tokens, slot = req.get_fill_ids(), self.slot_of(req)
            seq = seqs[i] if seqs else req.kv_committed_len
            for layer in range(L):
                k_rows = self.pool.get_key_buffer(layer)[slot * c: slot * c + seq]
                v_rows = self.pool.get_value_buffer(layer)[slot * c: slot * c + seq]
                want = [kv_of(tokens, pos, layer) for pos in range(seq)]
                # the message names the request only: a tensor's repr here once ended in a
                # segmentation fault (GPU machine, torch 2.11) and hid which check failed
                assert torch.equal(k_rows, torch.stack([a for a, _ in want])), f"{req.rid} layer {layer}: K"
                assert torch.equal(v_rows, torch.stack([b for _, b in want])), f"{req.rid} layer {layer}: V"

    def idle_free(self) -> int:
        """SGLang's idle check: free + evictable tokens."""
        evictable = self.tree.evictable_size() if isinstance(self.tree, RadixCache) else 0
        return self.alloc.available_size() + evictable


class GraphRunner:
    """SGLang 0.5.17's decode CUDA-graph runner as the attention backend sees it: ``load_batch``
    pads the batch to a captured size in its persistent buffers (stale request rows, length 1)
    and hands the backend SGLang's own replay view of it (``build_replay_fb_view``), which has no
    request ids."""

    def __init__(self, model_runner):
        self.attn_backend = model_runner.attn_backend
        self.max_bs = model_runner.max_bs

    def load_batch(self, forward_batch, pp_proxy_tensors=None):
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
        raw = forward_batch.batch_size
        bs = min(self.max_bs, 1 << (raw - 1).bit_length())      # the captured sizes: powers of 2
        rows = torch.zeros(bs, dtype=torch.int64)
        rows[:raw] = forward_batch.req_pool_indices
        seq = torch.ones(bs, dtype=torch.int64)
        seq[:raw] = forward_batch.seq_lens
        buffers = SimpleNamespace(input_ids=torch.zeros(bs, dtype=torch.int64), positions=seq - 1,
                                  req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.clone(),
                                  encoder_lens=None, mamba_track_indices=None)
        view = build_replay_fb_view(forward_batch, buffers, bs, raw, bs, 1,
                                    forward_batch.forward_mode, False)
        self.attn_backend.init_forward_metadata_out_graph(view)
        return view
