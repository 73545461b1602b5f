"""The engine-version-independent half of the adapter: request -> slot, paging, store, attention.

The hook layer (:mod:`.kv_hooks`, one small patch per vLLM version) tells a :class:`VattnRuntime`
what the model runner did each step; the attention backend asks it for the step's slots and runs
store + attention on the virtually contiguous views of a :class:`vattn.core.VirtualKVCache`.
Token ``p`` of a request in slot ``s`` is row ``s * rows_per_slot + p`` of every layer view.

One runtime exists per worker process (it is the process's KV cache, like vLLM's own); it is
created by the hook when the runner starts and looked up by the backend with :func:`current`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError, SlotError, VattnError
from vattn.core import ops

__all__ = ["VattnRuntime", "StepPlan", "current", "install", "uninstall", "layer_index"]

_RUNTIME: list["VattnRuntime"] = []   # the worker process's runtime (at most one)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Per-step device inputs shared by every layer.

    ``slots``: ``[B]`` int64 slot of each batch row; ``rows``: ``[N]`` int64 cache row of each
    scheduled token (``slot * rows_per_slot + position``).
    """

    slots: torch.Tensor
    rows: torch.Tensor


class VattnRuntime:
    """Slots, paging and attention for one vLLM worker.

    Parameters
    ----------
    config : KVCacheConfig
        Built by :func:`config_from_vllm` from the engine's model / scheduler config.
    """

    def __init__(self, config: KVCacheConfig):
        self.cache = VirtualKVCache(config)
        self.rows_per_slot = self.cache.layout.rows_per_slot
        self._slot_of: dict[str, int] = {}
        self._plan: StepPlan | None = None
        self._backend: dict[str, str] = {}

    # -- host side: called by the hook once per step --------------------------------------------
    def finish(self, req_ids) -> None:
        """Release the slots of requests that left (finished, aborted or preempted)."""
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self.cache.release(slot)

    def plan_step(self, batch: list[tuple[str, int, int]]) -> list[str]:
        """Map pages for this step and build the per-token rows.

        Parameters
        ----------
        batch : list of (req_id, num_computed_tokens, num_scheduled_tokens)
            In batch-row order (the order of the attention metadata rows).

        Returns
        -------
        list[str]
            Requests whose pages could not be mapped (the engine must preempt them).
        """
        lengths, slots, rows = {}, [], []
        for req_id, done, new in batch:
            slot = self._slot_of.get(req_id)
            if slot is None:
                slot = self._slot_of[req_id] = self.cache.acquire(expected_len=done + new)
            lengths[slot] = done + new
            slots.append(slot)
            base = slot * self.rows_per_slot + done
            rows.extend(range(base, base + new))
        failed = set(self.cache.step(lengths))
        device = self.cache.config.torch_device
        self._plan = StepPlan(torch.tensor(slots, dtype=torch.int64, device=device),
                              torch.tensor(rows, dtype=torch.int64, device=device))
        return [req_id for req_id, _, _ in batch if self._slot_of[req_id] in failed]

    def has_plan(self) -> bool:
        """Whether a step is being executed (False during vLLM's dummy/profile runs)."""
        return self._plan is not None

    def end_step(self) -> None:
        self._plan = None

    def slot(self, req_id: str) -> int:
        if req_id not in self._slot_of:
            raise SlotError(f"request {req_id!r} holds no vattn slot")
        return self._slot_of[req_id]

    # -- device side: called by every attention layer --------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
               max_seq_len: int, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V of ``layer`` and attend (prefill and decode rows mixed).

        Parameters
        ----------
        q : ``[N, Hq, D]``; k, v : ``[N, Hk, D]`` (``N`` = scheduled tokens, padding excluded).
        query_start_loc : ``[B + 1]`` int32; seq_lens : ``[B]`` int32 (keys incl. new tokens).
        out : ``[N, Hq, D]`` written in place and returned.
        """
        plan = self._plan
        if plan is None:
            raise VattnError("attention ran before the hook planned the step")
        n = plan.rows.shape[0]
        cache = self.cache
        ops.store(cache.k_rows(layer), cache.v_rows(layer), k[:n].to(cache.config.dtype),
                  v[:n].to(cache.config.dtype), plan.rows)
        name = self._backend.get("prefill")
        if name is None:
            name = self._backend["prefill"] = ops.resolve_backend(
                "prefill", device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
        return ops.prefill(q[:n], cache.k(layer), cache.v(layer), cu_seqlens_q=query_start_loc,
                           slots=plan.slots, seqlens_k=seq_lens, max_seqlen_q=max_query_len,
                           max_seqlen_k=max_seq_len, scale=scale, causal=True, backend=name,
                           out=out[:n])

    def close(self) -> None:
        self.cache.close()


def config_from_vllm(vllm_config, *, device: str) -> KVCacheConfig:
    """A :class:`KVCacheConfig` for this rank: KV heads of the rank, slots = ``max_num_seqs``."""
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    num_layers = model.get_num_layers(par)
    budget = os.environ.get("VATTN_PAGE_BUDGET", "256MiB" if device == "cpu" else "0.5")
    return KVCacheConfig(num_layers=num_layers, num_kv_heads=model.get_num_kv_heads(par),
                         head_dim=model.get_head_size(), dtype=model.dtype,
                         max_slots=vllm_config.scheduler_config.max_num_seqs,
                         max_context=model.max_model_len,
                         group_size=int(os.environ.get("VATTN_GROUP_SIZE", "1")),
                         page_budget=_parse_budget(budget), device=device,
                         map_ahead_tokens=0 if device == "cpu" else 256)


def _parse_budget(text: str) -> int | float:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    try:
        return float(text) if "." in text else int(text)
    except ValueError as exc:
        raise ConfigError(f"VATTN_PAGE_BUDGET must be bytes, '<n>MiB' or a fraction, got {text!r}") from exc


def layer_index(layer_name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not found:
        raise ConfigError(f"cannot find a layer index in {layer_name!r}")
    return int(found[0])


def install(runtime: VattnRuntime) -> None:
    if _RUNTIME:
        raise VattnError("a vattn runtime is already installed in this process")
    _RUNTIME.append(runtime)


def uninstall() -> None:
    while _RUNTIME:
        _RUNTIME.pop().close()


def current() -> VattnRuntime:
    """The process's runtime; raises if the vattn hooks did not start one."""
    if not _RUNTIME:
        raise VattnError("the vattn attention backend is selected but the vattn KV hooks are not "
                         "active in this process (is VATTN_VLLM=1 set and the plugin installed?)")
    return _RUNTIME[0]
