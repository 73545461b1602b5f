"""The TGI worker's CPU kernel stand-ins and local tokenizer, and the conformance runner's own
logic (no TGI needed)."""

import pytest
import torch

from vattn.conformance.runners.tgi import TgiRunner, vattn_env
from vattn.conformance.workers import tgi_cpu as cpu
from vattn.core.errors import UnsupportedError


def _rotate_half_reference(x, cos, sin):
    # the Llama (GPT-NeoX) rotation on [T, H, D] with cos/sin [T, 1, D/2]
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat([-x2, x1], -1) * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_in_place_on_aliased_halves(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=dtype)
    ang = torch.randn(5, 1, 8)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    expect = _rotate_half_reference(x.float(), cos.float(), sin.float())
    x1, x2 = x[..., :8], x[..., 8:]
    cpu.apply_rotary(x1, x2, cos, sin, x1, x2, False)  # outputs alias inputs, as TGI calls it
    torch.testing.assert_close(x.float(), expect, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)


def test_dropout_add_ln_fwd_rms_mode():
    torch.manual_seed(1)
    x0, res, gamma = torch.randn(7, 32), torch.randn(7, 32), torch.rand(32) + 0.5
    z, x, *_ = cpu.dropout_add_ln_fwd(x0, res, gamma, None, None, None, None, None, 0.0, 1e-6,
                                      1.0, 0, None, False, True)
    s = x0 + res
    torch.testing.assert_close(x, s)
    torch.testing.assert_close(z, gamma * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    z2, x2, *_ = cpu.dropout_add_ln_fwd(x0, None, gamma, None, None, None, None, None, 0.0, 1e-6,
                                        1.0, 0, None, False, True)
    assert x2 is None                                  # the kernel's convention TGI relies on
    with pytest.raises(UnsupportedError, match="dropout"):
        cpu.dropout_add_ln_fwd(x0, res, gamma, None, None, None, None, None, 0.1, 1e-6,
                               1.0, 0, None, False, True)


def test_fast_layer_norm_returns_sum_as_residual():
    ln = cpu.FastLayerNorm(8)
    h, r = torch.randn(3, 8), torch.randn(3, 8)
    out, res = ln(h, r)
    torch.testing.assert_close(res, h + r)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(h + r, (8,), ln.weight, ln.bias))


def test_moe_stub_raises_when_called():
    stub = cpu._moe_stub()
    with pytest.raises(UnsupportedError, match="moe_kernels"):
        stub.fused_moe.fused_topk()


def test_local_tokenizer_maps_words_to_ids():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from vattn.conformance.workers.tgi import local_tokenizer_class
    tok = local_tokenizer_class(50).from_pretrained("unused")
    assert tok("t5 t17 t49 t3", add_special_tokens=False)["input_ids"] == [5, 17, 49, 3]
    assert tok.decode([5, 17]) == "t5 t17"


def test_vattn_env_budget_and_options():
    env = vattn_env(3, 100, num_layers=2, kv_heads=2, head_dim=64, dtype_bytes=4, page_bytes=1 << 16,
                    options={"group_size": 2})
    # 100 tokens * 1 KiB per layer = 2 pages (+1 rounding) per layer; 3 slots + padding + 1 spare
    assert env["VATTN_TGI_PAGE_BUDGET"] == str(5 * 2 * 3 * (1 << 16))
    assert (env["VATTN_TGI"], env["ATTENTION"], env["PREFIX_CACHING"]) == ("1", "flashdecoding", "0")
    assert (env["VATTN_TGI_MAX_SLOTS"], env["VATTN_TGI_GROUP_SIZE"]) == ("3", "2")


def test_runner_modes_and_errors():
    runner = TgiRunner()
    assert runner.modes == ("reference", "vattn") and runner.name == "tgi"
    with pytest.raises(UnsupportedError, match="CPU only"):
        runner.run("vattn", "m", [[1]], 2, device="cuda")
    with pytest.raises(UnsupportedError, match="mode"):
        runner.run("stock", "m", [[1]], 2)


def test_runner_rejects_bad_mode():
    with pytest.raises(UnsupportedError, match="mode"):
        TgiRunner().run("fast", "m", [[1]], 2)
