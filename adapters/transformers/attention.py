"""The ``paged|vattn`` attention function: ``vattn.core.ops`` on the cache's virtual layer views.

Per layer and step: one ``store`` of the step's new K/V into rows ``slot * R + position`` of the
layer view (transformers' ``write_index`` already holds exactly these rows), then ``decode`` (every
request has one query token) or varlen ``prefill`` (causal, bottom-right, on the cached prefix)
reading the virtually contiguous K/V in place: no gather, no copy, no mask.

What the kernels need beyond transformers' own kwargs (a slot and a key count per request) is
derived on the device once per forward (:func:`plan_step`), so nothing is read back to the host:
the host ints ``max_seqlen_q`` / ``max_seqlen_k`` transformers already computed pick the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vattn.core import ops
from vattn.core.errors import ConfigError, UnsupportedError

from .cache import VattnPagedCache

__all__ = ["vattn_paged_attention", "StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """Device tensors of one forward, shared by every layer.

    Attributes
    ----------
    slots : torch.Tensor
        ``[B]`` int64, the slot of each request.
    seqlens_k : torch.Tensor
        ``[B]`` int32, keys of each request including this step's tokens (0 for padding sequences).
    """

    slots: torch.Tensor
    seqlens_k: torch.Tensor


def plan_step(write_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              rows_per_slot: int) -> StepPlan:
    """Slots and key counts from transformers' batch tensors (graph-safe, no host sync).

    Parameters
    ----------
    write_index : torch.Tensor
        ``[N]`` int64 rows the step's tokens are written to (``slot * rows_per_slot + position``).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor
        ``[B + 1]`` int32 cumulative query / key lengths (padding sequences repeat the last value).
    rows_per_slot : int
        ``cache.vattn.layout.rows_per_slot``.
    """
    first = cu_seqlens_q[:-1].to(torch.int64).clamp(max=write_index.shape[0] - 1)  # first token of each request
    slots = torch.div(write_index[first], rows_per_slot, rounding_mode="floor")
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return StepPlan(slots=slots, seqlens_k=seqlens_k)


def vattn_paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """Attention of one layer over the requests' vattn slots.

    Parameters
    ----------
    module
        The attention module (``layer_idx`` is read).
    query : torch.Tensor
        ``[1, Hq, N, D]``, the step's tokens of every request packed.
    key, value : torch.Tensor
        ``[1, Hk, N, D]``, the step's new K/V (stored here, then read back from the view).
    attention_mask
        Ignored (``None``: the kernels mask causally by themselves).
    scaling : float, optional
        Softmax scale, default ``D ** -0.5``.
    **kwargs
        transformers' continuous-batching kwargs: ``cache``, ``write_index``, ``cu_seq_lens_q``,
        ``cu_seq_lens_k``, ``max_seqlen_q``, ``max_seqlen_k``.

    Returns
    -------
    tuple
        ``([1, N, Hq, D] attention output, None)``.
    """
    cache = kwargs.get("cache")
    if not isinstance(cache, VattnPagedCache) or cache.vattn is None:
        raise ConfigError("paged|vattn needs the vattn cache: call vattn.adapters.transformers.enable(model) "
                          "before generate_batch / init_continuous_batching")
    if dropout:
        raise UnsupportedError(f"paged|vattn runs inference only (dropout must be 0, got {dropout})")
    layer = module.layer_idx
    group = cache.layer_index_to_group_indices[layer][0]
    write_index = kwargs["write_index"][group]
    if layer == cache.first_layer or cache.step_plan is None:  # once per forward, on the device
        cache.step_plan = plan_step(write_index, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                    cache.vattn.layout.rows_per_slot)
    plan, be = cache.step_plan, cache.backends
    k_view, v_view = cache.layer_views(layer)
    ops.store(k_view, v_view, key[0].transpose(0, 1), value[0].transpose(0, 1), write_index,
              backend=be.store)
    q = query[0].transpose(0, 1).contiguous()                                 # [N, Hq, D]
    max_k = min(int(kwargs["max_seqlen_k"]), k_view.shape[1])
    if kwargs["max_seqlen_q"] == 1:  # pure decode step: one query token per request
        out = ops.decode(q, k_view, v_view, slots=plan.slots, seqlens=plan.seqlens_k, max_seqlen_k=max_k,
                         scale=scaling, backend=be.decode)
    else:
        out = ops.prefill(q, k_view, v_view, cu_seqlens_q=kwargs["cu_seq_lens_q"], slots=plan.slots,
                          seqlens_k=plan.seqlens_k, max_seqlen_q=int(kwargs["max_seqlen_q"]),
                          max_seqlen_k=max_k, scale=scaling, causal=True, backend=be.prefill)
    return out.unsqueeze(0), None
