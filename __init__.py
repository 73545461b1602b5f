"""vattn: virtually contiguous KV caches for existing LLM serving engines.

``vattn.core`` is the engine-agnostic manager (CUDA virtual memory or a host
mmap/memfd backend); ``vattn.adapters.*`` plug it into vLLM, SGLang, TGI and
Hugging Face transformers; ``vattn.conformance`` checks each engine's outputs
and throughput against its own paged path.
"""

__version__ = "0.1.0"
