"""SGLang CPU test setup: importable modules (tools/engine_env.sh sglang) and its real configurator.

SGLang imports ``torchvision`` at module level; where no torchvision is installed an import-only
stand-in is registered (:mod:`vattn.bench.sglang_cpu`).
"""

import faulthandler
import os

from vattn.bench.sglang_cpu import ensure_importable

ensure_importable()


#: ``$VATTN_CRASH_LOG``, open for the process's life: where the Python frames of a crash go
_CRASH_LOG = open(os.environ["VATTN_CRASH_LOG"], "a") if os.environ.get("VATTN_CRASH_LOG") else None


# -- SGLang's own KV-cache configurator on the CPU ------------------------------------------------
import json  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2,
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=1024, max_position_embeddings=4096,
            torch_dtype="float32")


@pytest.fixture(scope="session")
def sglang_server_args(tmp_path_factory):
    """Real ``ServerArgs`` for a tiny Llama config (no weights), published as SGLang does."""
    pytest.importorskip("sglang.srt.mem_cache.kv_cache_configurator",
                        reason="sglang (CPU import set) not installed")
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(json.dumps(TINY))
    args = ServerArgs(model_path=str(model), device="cpu", page_size=16, disable_radix_cache=True,
                      skip_tokenizer_init=True, max_running_requests=3, context_length=96)
    publish(args, role="test")
    return args


@pytest.fixture
def configure_pools(sglang_server_args, monkeypatch):
    """``build(platform, num_tokens)``: SGLang's ``KVCacheConfigurator._init_pools`` on the CPU.

    ``platform`` replaces the configurator module's ``current_platform`` (SGLang resolved the
    process-wide one at import: the CPU platform here); ``None`` keeps it.
    """
    import torch
    from sglang.srt.mem_cache import kv_cache_configurator as kcc
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    mc = sglang_server_args.get_model_config()
    layers = ModelLayerInfo(start_layer=0, end_layer=mc.num_hidden_layers,
                            num_effective_layers=mc.num_hidden_layers)

    def build(platform=None, num_tokens=512):
        if platform is not None:
            monkeypatch.setattr(kcc, "current_platform", platform)
        cfg = kcc.KVCacheConfigurator(
            device="cpu", gpu_id=0, ps=SimpleNamespace(attn_dp_size=1, pp_size=1), pp_group=None,
            model=None, model_config=mc, server_args=sglang_server_args,
            kv_cache_dtype=torch.float32, model_dtype=torch.float32, page_size=16,
            sliding_window_size=None, spec_algorithm=SpeculativeAlgorithm.NONE,
            is_draft_worker=False, post_capture_kv_active=False, spec_aux_config=None,
            is_hybrid_swa=False, is_hybrid_swa_compress=False, use_mla_backend=False,
            layer_info=layers, forward_stream=None, req_to_token_pool=None,
            token_to_kv_pool_allocator=None, memory_pool_config=None)
        with get_parallel().override(attn_tp_size=1, attn_dp_size=1, tp_size=1, pp_size=1,
                                     dcp_size=1):
            sizes = cfg._derive_pool_sizes(config=MemoryPoolConfig(
                max_total_num_tokens=num_tokens, max_running_requests=3))
            return cfg._init_pools(sizes=sizes, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=None)

    return build


@pytest.fixture(autouse=True)
def python_frames_on_a_crash():
    """With ``$VATTN_CRASH_LOG`` set (the GPU runner sets it), Python's faulthandler is put back
    on top before every test: ``tvm_ffi`` (an SGLang dependency, loaded when a test module
    imports SGLang) installs its own SIGSEGV handler over it, which prints C frames only (a
    crash on the GPU machine named no test line). faulthandler dumps the Python frames to the
    file (pytest captures stderr, and a crashed process never hands the capture back), then
    chains to the handler it replaced. ``enable`` alone does nothing while it is on."""
    if _CRASH_LOG is not None:
        faulthandler.disable()
        faulthandler.enable(file=_CRASH_LOG, all_threads=True)
    yield
