"""The GPU stages behind ``tools/gpu/vllm.sh`` and ``tools/gpu/sglang.sh``.

:mod:`.vllm_stages` and :mod:`.sglang_stages` are the engines' stages
(``python -m vattn.bench.gpu.<engine>_stages STAGE --out DIR``), each mode through the engine's
conformance runner (:mod:`vattn.conformance.runners`); :mod:`.workloads` holds the workloads and
model shapes of both, :mod:`.stage` what every stage shares (command line, the JSON it always
writes, settings read from the environment), :mod:`.report` the columns computed from the
engines' results, :mod:`.paired` two engines up at once with their generations alternated.
``vattn bench engine`` (:mod:`vattn.bench.engine`) renders the stages' JSONs.
"""
