"""Backend resolution is a pure function of (installed, device, capability, dtype, head_dim)."""

import pytest
import torch

from vattn.core.errors import TensorError, UnsupportedError
from vattn.core.ops import BACKENDS, decode, installed_backends, is_supported, resolve_backend
from vattn.core.ops.synthetic import group_views

ALL = frozenset(BACKENDS)
HOPPER, AMPERE = (9, 0), (8, 0)


def _resolve(op, installed, capability=HOPPER, dtype=torch.bfloat16, head_dim=128, device="cuda"):
    return resolve_backend(op, device=device, dtype=dtype, head_dim=head_dim, installed=installed,
                           capability=capability)


@pytest.mark.parametrize("installed,capability,decode_be,prefill_be", [
    (ALL, HOPPER, "vllm_fa3", "vllm_fa3"),
    (ALL, AMPERE, "vllm_fa2", "vllm_fa2"),
    (frozenset({"sgl_fa3", "triton", "torch_fa2"}), HOPPER, "sgl_fa3", "sgl_fa3"),
    (frozenset({"sgl_fa3", "triton", "torch_fa2"}), AMPERE, "triton", "torch_fa2"),
    (frozenset({"flash_attn", "triton"}), AMPERE, "flash_attn", "flash_attn"),
    (frozenset({"flashinfer", "triton", "torch_fa2"}), HOPPER, "triton", "torch_fa2"),
    (frozenset({"torch_fa2"}), HOPPER, "torch_fa2", "torch_fa2"),
    # vLLM's FA2 is sm80 code: on Hopper its first use is a driver JIT of minutes, auto passes it over
    (frozenset({"vllm_fa2", "triton", "torch_fa2"}), HOPPER, "triton", "torch_fa2"),
    (frozenset({"vllm_fa2", "triton", "torch_fa2"}), AMPERE, "vllm_fa2", "vllm_fa2"),
])
def test_auto_order(installed, capability, decode_be, prefill_be):
    assert _resolve("decode", installed, capability) == decode_be
    assert _resolve("prefill", installed, capability) == prefill_be
    # pure: same inputs, same answer
    assert _resolve("decode", installed, capability) == decode_be


def test_cpu_resolves_to_reference():
    for op in ("decode", "prefill"):
        assert _resolve(op, ALL, None, torch.float32, 40, "cpu") == "reference"
        assert _resolve(op, frozenset(), None, torch.bfloat16, 7, "cpu") == "reference"


def test_clear_errors():
    with pytest.raises(UnsupportedError, match="head_dim"):
        _resolve("decode", ALL, HOPPER, head_dim=300)
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        _resolve("decode", ALL, HOPPER, dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="Hopper"):
        resolve_backend("decode", device="cuda", dtype=torch.float16, head_dim=128,
                        backend="vllm_fa3", installed=ALL, capability=AMPERE)
    with pytest.raises(UnsupportedError, match="not installed"):
        resolve_backend("decode", device="cuda", dtype=torch.float16, head_dim=128,
                        backend="sgl_fa3", installed=frozenset(), capability=HOPPER)
    with pytest.raises(UnsupportedError, match="decode only"):
        resolve_backend("prefill", device="cuda", dtype=torch.float16, head_dim=128,
                        backend="triton", installed=ALL, capability=HOPPER)
    with pytest.raises(UnsupportedError, match="unknown backend"):
        resolve_backend("decode", device="cpu", dtype=torch.float16, head_dim=128, backend="x")
    with pytest.raises(UnsupportedError, match="unknown op"):
        _resolve("encode", ALL)
    with pytest.raises(UnsupportedError, match="CUDA"):
        resolve_backend("decode", device="cpu", dtype=torch.float16, head_dim=128,
                        backend="triton", installed=ALL)


def test_is_supported_matches_resolution():
    assert is_supported("triton", op="decode", device_type="cuda", dtype=torch.float16,
                        head_dim=64, capability=AMPERE, installed=ALL)
    assert not is_supported("triton", op="decode", device_type="cuda", dtype=torch.float16,
                            head_dim=64, capability=AMPERE, installed=frozenset())
    assert is_supported("reference", op="prefill", device_type="cpu", dtype=torch.float32,
                        head_dim=3, installed=frozenset())


def test_installed_backends_probe_does_not_import():
    import sys
    found = installed_backends()
    assert "reference" in found and "torch_fa2" in found
    assert "vllm" not in sys.modules or "vllm_fa3" in found


def test_bad_strides_and_devices():
    k, v, keep = group_views(slots=3, rows_per_slot=16, group_size=2, kv_heads=2, head_dim=8,
                             dtype=torch.float32)
    q = torch.randn(2, 4, 8)
    slots, lens = torch.tensor([0, 2]), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(TensorError, match="strides of k_cache"):
        decode(q, k[:, :8], v[:, :8], slots=slots, seqlens=lens)    # slot stride != rows * row
    with pytest.raises(TensorError, match="strides of k_cache"):
        decode(q, k.transpose(2, 3), v.transpose(2, 3), slots=slots, seqlens=lens)
    with pytest.raises(TensorError, match="shape of k_cache"):
        decode(q, k[0], v[0], slots=slots, seqlens=lens)
    with pytest.raises(TensorError, match="dtype of slots"):
        decode(q, k, v, slots=slots.float(), seqlens=lens)
    if torch.cuda.is_available():
        with pytest.raises(TensorError, match="on"):
            decode(q.cuda(), k, v, slots=slots, seqlens=lens)


def test_explicit_vllm_fa2_still_allowed_on_hopper_and_auto_says_why_it_skips():
    assert _resolve("decode", ALL, HOPPER) == "vllm_fa3"
    only = frozenset({"vllm_fa2"})
    assert resolve_backend("decode", device="cuda", dtype=torch.bfloat16, head_dim=128,
                           installed=only, capability=HOPPER, backend="vllm_fa2") == "vllm_fa2"
    with pytest.raises(UnsupportedError, match="JIT-compiles"):
        _resolve("decode", only, HOPPER)
