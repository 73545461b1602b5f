"""The conformance runners: one per engine, each generating the same prompts on the engine's
stock path and on vattn (:class:`vattn.conformance.protocol.EngineRunner`).

:mod:`.transformers` runs in this process; :mod:`.vllm`, :mod:`.sglang` and :mod:`.tgi` start
one engine process per run (:mod:`.process`), whose side is a worker of
:mod:`vattn.conformance.workers` (spec JSON in, result JSON out). Registered by name in
:mod:`vattn.conformance.engines`.
"""
