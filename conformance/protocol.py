"""The engine protocol every conformance runner implements.

A runner generates the same prompts with the same (greedy) sampling on the
engine's stock paged path and on vattn, so the two :class:`RunResult` objects
can be compared token by token (:mod:`vattn.conformance.identity`) and by
throughput (:mod:`vattn.conformance.throughput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["RunResult", "EngineRunner"]


@dataclass
class RunResult:
    """What one engine run returns.

    Attributes
    ----------
    token_ids
        Generated token ids per prompt, in prompt order (prompt tokens excluded).
    logprobs
        Per prompt, per generated position: ``{token_id: logprob}`` of the top-k
        tokens, always including the chosen token; ``None`` if not requested.
    seconds
        Wall time of generation only (engine init and weight loading excluded).
    num_prompt_tokens
        Total prompt tokens over all prompts.
    num_generated_tokens
        Total generated tokens over all prompts.
    extra
        Engine-specific metrics (e.g. vattn cache metrics, ttft, preemptions).
    """

    token_ids: list[list[int]]                 # generated ids per prompt (prompt order)
    logprobs: list[list[dict[int, float]]] | None  # per generated position: {token_id: logprob} top-k, including the chosen token
    seconds: float                             # wall time of generation only (engine init excluded)
    num_prompt_tokens: int
    num_generated_tokens: int
    extra: dict = field(default_factory=dict)  # engine-specific metrics (e.g. vattn cache metrics)


@runtime_checkable
class EngineRunner(Protocol):
    """An engine that can generate on its stock paged path and on vattn.

    ``modes[0]`` is the baseline every other mode is compared with.
    ``run`` must use greedy sampling, generate exactly ``max_new_tokens`` per
    prompt (EOS ignored), and, when ``arrival_times`` is given (seconds from the
    start, one per prompt), submit prompt ``i`` no earlier than its arrival time.
    """

    name: str                      # "transformers" | "vllm" | "sglang" | "tgi"
    modes: tuple[str, ...]         # e.g. ("stock", "vattn") or ("stock", "ceiling", "vattn"); first = baseline

    def run(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
            logprobs: int = 5, device: str = "cpu", dtype: str = "float32",
            arrival_times: list[float] | None = None) -> RunResult: ...
