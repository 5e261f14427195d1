"""cpu_compat lets Megatron-Core's GPTModel train on a CPU-only process, and undoes itself."""

import pytest
import torch

from megatron_longctx.megatron import cpu_compat
from tests.dist import megatron_parallel, run_ranks


def test_enabled_is_scoped_and_restores():
    if not cpu_compat.needed():
        pytest.skip("CUDA is available: cpu_compat is a no-op here")
    original = torch.cuda.current_device
    with cpu_compat.enabled():
        with cpu_compat.enabled():  # nests
            assert torch.cuda.current_device() == torch.device("cpu")
            torch.cuda.synchronize()  # nothing to wait for
        assert cpu_compat.is_enabled()
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.pipeline_parallel import schedules

        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"

        class _Group:  # the zigzag slice only asks the group for its size and rank
            def __init__(self, size, rank):
                self.size, self.rank = (lambda: size), (lambda: rank)

        emb = torch.arange(8.0).view(8, 1, 1, 1)  # [s, 1, 1, d]
        sliced = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _Group(2, 1))
        assert sliced.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.cuda.manual_seed(7)
        assert torch.equal(a, torch.rand(3))  # the "CUDA" generator is the CPU generator
    assert not cpu_compat.is_enabled()
    assert torch.cuda.current_device is original
    with pytest.raises(Exception):
        torch.zeros(1, device="cuda")


def test_sliding_window_mask_of_megatron_s_own_attention_is_built_on_the_cpu():
    if not cpu_compat.needed():
        pytest.skip("CUDA is available: cpu_compat is a no-op here")
    from megatron.core.transformer import utils as transformer_utils

    with cpu_compat.enabled():
        mask = transformer_utils.get_sliding_window_causal_mask(4, 4, (1, 0))  # True = masked
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    assert mask.device.type == "cpu"
    assert torch.equal(mask, (cols > rows) | (cols < rows - 1))  # each query sees itself and 1 key back


def _tiny_gpt_grads(recompute: bool, seed: int):
    """Loss and parameter gradients of a 2-layer GPT with dropout, TP=2, on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    with cpu_compat.enabled(), megatron_parallel(tp=2):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        cfg = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
            use_cpu_initialization=True, hidden_dropout=0.2, attention_dropout=0.1, **extra,
        )
        model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                         position_embedding_type="rope")
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        position_ids = torch.arange(16).expand(2, 16)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _recompute_replays_dropout():
    loss_plain, grads_plain = _tiny_gpt_grads(recompute=False, seed=11)
    loss_re, grads_re = _tiny_gpt_grads(recompute=True, seed=11)
    assert torch.isfinite(torch.tensor(loss_plain))
    assert loss_plain == pytest.approx(loss_re, rel=1e-6)
    assert grads_plain.keys() == grads_re.keys() and len(grads_plain) > 0
    for name in grads_plain:
        assert grads_plain[name].abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(grads_re[name], grads_plain[name], rtol=1e-5, atol=1e-6, msg=name)
    # A different seed draws different dropout masks: the comparison above can fail.
    loss_other, _ = _tiny_gpt_grads(recompute=False, seed=12)
    assert loss_other != loss_plain


def test_gpt_forward_backward_on_cpu_with_recompute():
    run_ranks(2, _recompute_replays_dropout)


def test_training_stack_patches_are_scoped():
    try:
        from megatron.training import initialize
    except ImportError:
        pytest.skip("this megatron-core has no megatron.training (the 0.16.1 wheel ships none)")
    if not cpu_compat.needed():
        pytest.skip("CUDA is available: cpu_compat is a no-op here")
    from megatron.training import arguments

    original_torch = initialize.torch
    t = torch.zeros(2, dtype=torch.bfloat16)
    with cpu_compat.enabled():
        assert t.cuda() is t and t.type() == "torch.cuda.BFloat16Tensor"  # the optimizers' type checks
        assert t.type(torch.float32).dtype == torch.float32  # a conversion is still one
        assert initialize.torch.cuda.device_count() == 1  # model-parallel groups and RNG tracker get set up
        assert arguments.get_device_arch_version() == 0
    assert "cuda" not in vars(torch.Tensor) and "type" not in vars(torch.Tensor)  # inherited again
    assert initialize.torch is original_torch and t.type() == "torch.BFloat16Tensor"


def test_cpu_default_args_explicit_flags_win(monkeypatch):
    monkeypatch.delenv(cpu_compat.MAX_CONNECTIONS_ENV, raising=False)  # restored after the test
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        pytest.skip("this megatron-core has no megatron.training (the 0.16.1 wheel ships none)")
    argv, added = cpu_compat.cpu_default_args(["--distributed-backend", "nccl", "--transformer-impl=local"])
    if not cpu_compat.needed():
        assert added == []
        return
    assert argv[:3] == ["--distributed-backend", "nccl", "--transformer-impl=local"]
    assert not any(a.startswith(("--distributed-backend", "--transformer-impl")) for a in added)
    assert {"--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion"} <= set(added)
    assert f"{cpu_compat.MAX_CONNECTIONS_ENV}=1" in added
