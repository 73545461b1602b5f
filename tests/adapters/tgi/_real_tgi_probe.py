"""Run in a fresh interpreter (the hook must precede TGI's imports): exercise the adapter with
TGI's real modules. Prints one line per check; exits non-zero on the first failure."""

import os
from types import SimpleNamespace

os.environ.update(VATTN_TGI="1", ATTENTION="flashdecoding", PREFIX_CACHING="0",
                  VATTN_TGI_MAX_SLOTS="3", VATTN_TGI_MAX_CONTEXT="64",
                  VATTN_TGI_PAGE_BUDGET=str(4 << 20), VATTN_TGI_PAGE_BYTES="4096")

import torch  # noqa: E402

from vattn.adapters.tgi import activate  # noqa: E402

patcher = activate.install()
import text_generation_server.models as tgi_models  # noqa: E402  (what the server imports first)
import text_generation_server.cache  # noqa: E402,F401
from text_generation_server.layers import attention as tgi_attn  # noqa: E402
from text_generation_server.layers.attention.kv_cache import KVCache, KVScales  # noqa: E402
from text_generation_server.models.flash_causal_lm import FlashCausalLM  # noqa: E402

print("applied", sorted(patcher.applied))
print("flash_models", tgi_models.FLASH_ATTENTION)
model = SimpleNamespace()
FlashCausalLM.init_kv_cache(model, 123, 2, 2, 16, torch.float32, torch.device("cpu"))
rt = patcher.runtime
C = rt.cache.layout.rows_per_slot
batch = SimpleNamespace(requests=[SimpleNamespace(id=7)], slots=torch.arange(10, dtype=torch.int64),
                        cu_slots=torch.tensor([0, 10]), block_tables_tensor=torch.zeros(1, 1, dtype=torch.int32),
                        cache_lengths=[0], input_lengths=[6])
(slot,) = rt.bind(batch)
one = torch.tensor(1.0)
layer = model.kv_cache[1]
key, value = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
layer.store(key=key, value=value, slots=batch.slots[:6], kv_scales=KVScales(one, one))
assert torch.equal(rt.cache.k(1)[slot, :6], key) and torch.equal(rt.cache.v(1)[slot, :6], value)
print("store_rows", slot, C)
seqlen = tgi_attn.Seqlen(input_lengths=torch.ones(1, dtype=torch.int32),
                         cache_lengths=torch.tensor([5], dtype=torch.int32), max_k=6)
q = torch.randn(1, 4, 16)
out = tgi_attn.paged_attention(q, layer, None, 0.25, batch.block_tables_tensor, seqlen, 6,
                               kv_scales=KVScales(one, one))
k, v = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
ref = torch.softmax(torch.einsum("hd,thd->ht", q[0], k) * 0.25, -1)
torch.testing.assert_close(out[0], torch.einsum("ht,thd->hd", ref, v))
print("decode_matches")
cache = text_generation_server.cache.Cache()
cache.set(SimpleNamespace(batch_id=1, requests=batch.requests))
cache.delete(1)
assert rt.slot_of.as_dict() == {}
print("released_on_delete")

# A real FlashCausalLMBatch from TGI's protobuf (warmup-style: no router blocks), then filter.
from text_generation_server.models.flash_causal_lm import FlashCausalLMBatch  # noqa: E402
from text_generation_server.models.globals import set_adapter_to_index  # noqa: E402
from text_generation_server.pb import generate_pb2 as pb  # noqa: E402

set_adapter_to_index({})
params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
reqs = [pb.Request(id=i, inputs="x", parameters=params, top_n_tokens=0,
                   stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=4)) for i in (21, 22)]
tok = SimpleNamespace(eos_token_id=0, _eos_token_ids={0})
b = FlashCausalLMBatch.from_tokenized(pb.Batch(id=1, requests=reqs, size=2), tok, [[1, 2, 3], [4, 5, 6, 7, 8]],
                                      torch.float32, torch.device("cpu"))
b.prepare_for_prefill()
s21, s22 = rt.bind(b)
assert b.slots[b.slot_indices].tolist() == [s21 * C + t for t in range(3)] + [s22 * C + t for t in range(5)]
assert b.block_tables_tensor[:, 0].tolist() == [s21, s22]
kept = b.filter([22])
assert rt.slot_of.as_dict() == {22: s22} and kept.block_tables_tensor[:, 0].tolist() == [s22]
assert kept.slots[:5].tolist() == [s22 * C + t for t in range(5)]
print("real_batch_bind_filter")
