"""vattn for SGLang 0.5.17 (other versions are refused: :mod:`.version`).

Pieces, all through SGLang's official extension points:

* :mod:`.platform` (entry point ``sglang.srt.platforms``, opt-in ``VATTN_SGLANG=1``): SGLang's
  CUDA platform whose ``get_mha_kv_pool_cls`` / ``get_paged_allocator_cls`` make
  ``KVCacheConfigurator`` build :class:`.pool.VattnMHATokenToKVPool` and
  :class:`.allocator.VattnTokenAllocator` (sized by :mod:`.sizing` from SGLang's token budget and
  ``req_to_token`` shape);
* :mod:`.plugin` (entry point ``sglang.srt.plugins``): ``--attention-backend vattn``
  (:mod:`.backend`; the CPU op path :mod:`.sdpa` is ``torch_native``'s math);
* :mod:`.metrics`: the allocator's counters, written from the scheduler process for benchmarks.

The runs that drive SGLang (``sglang.Engine`` stock ``fa3`` vs vattn, one engine process per
run) are harness, outside this package: :mod:`vattn.conformance.runners.sglang`,
:mod:`vattn.conformance.workers.sglang` and :mod:`vattn.bench.gpu.sglang_stages`
(``tools/gpu/sglang.sh``).

Verified on the CPU (``tests/adapters/sglang``, sglang 0.5.17 ``--no-deps`` + torch 2.13 CPU,
host VMM backend): SGLang's resolver ``_resolve_platform()`` finds the platform from
pyproject's entry point only with ``VATTN_SGLANG=1`` (stock platform otherwise); SGLang's
``KVCacheConfigurator._init_pools`` picks the vattn pool/allocator with the platform and the stock
``MHATokenToKVPool`` / ``PagedTokenToKVPoolAllocator`` without it; that configurator-built
ReqToTokenPool + pool + allocator, with the backend from the plugin's factory, run extend
(chunked) + decode + free through SGLang's allocation functions, ChunkCache and ForwardBatch,
bit-identical to ``torch_native``, and end idle with ``available_size() == max_total_num_tokens``.
Seam: the configurator module's ``current_platform`` is replaced by ``VattnCudaPlatform()`` (SGLang
resolves the process-wide platform once at import, and ``ServerArgs`` under a CUDA platform
queries CUDA memory).

Not verified anywhere yet: a real ``sglang.Engine`` / ``ModelRunner`` with the vattn platform
(needs CUDA: SGLang's CPU engine needs ``sgl_kernel``'s CPU build, not on PyPI), SGLang's CUDA
store kernels and ``vattn.core.ops`` FA3 on the CUDA VMM cache inside SGLang, the platform's
other out-of-tree branches (graph runner, piecewise backend, memory capacity) at run time, and
any throughput. ``tools/gpu/sglang.sh`` is written for that and has never run.
"""
