"""A Llama model in Hugging Face format, through Megatron-Bridge and back: a tiny ``LlamaForCausalLM`` written
with ``transformers`` (32-token positions) is imported with Bridge's ``AutoBridge``, trained 2 steps by Bridge's
own ``pretrain()`` with megatron-longctx at CP=2 (ring) on 64-token sequences, saved, and exported back to
Hugging Face format; the exported model's logits in ``transformers`` equal Megatron's (the saved model,
loaded by Bridge) on the same tokens, and its weights are the trained ones, not the imported ones.
Runs where ``megatron.bridge`` and ``transformers`` import (``make test-bridge``); skips elsewhere."""

from __future__ import annotations

import pytest

from tests.bridge.bridge_kit import bridge_available, import_bridge
from tests.bridge.test_pretrain import tiny_recipe
from tests.dist import run_ranks

pytestmark = pytest.mark.skipif(bridge_available() is not None, reason=str(bridge_available()))

SEQ, STEPS, VOCAB = 64, 2, 256


def _write_hf_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ // 2,
                         rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    _write_tokenizer(path)


def _write_tokenizer(path: str) -> None:
    """A word-level tokenizer of VOCAB tokens beside the model (Bridge's export copies the tokenizer along)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2")
    tokenizer.save_pretrained(path)


def _provider(hf_dir: str, load_weights: bool):
    """Bridge's provider for the HF model, on Megatron's local layers in float32 (no TE on the CPU)."""
    import torch
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.float32)
    m = bridge.to_megatron_provider(load_weights=load_weights)
    m.transformer_layer_spec, m.transformer_impl = local_layer_spec, "local"
    m.bf16, m.fp16, m.params_dtype, m.attention_dropout, m.hidden_dropout = False, False, torch.float32, 0.0, 0.0
    m.gradient_accumulation_fusion = m.bias_activation_fusion = m.bias_dropout_fusion = False
    m.masked_softmax_fusion = m.persist_layer_norm = m.apply_rope_fusion = False
    m.cross_entropy_loss_fusion = False
    return bridge, m


def _train(hf_dir: str, save: str) -> None:
    """Rank body: the imported model trained by Bridge's pretrain() at CP=2 (ring) at SEQ tokens, saved."""
    import_bridge()
    from megatron.bridge.training import gpt_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core import parallel_state

    from megatron_longctx.bridge import configure
    from megatron_longctx.megatron import cpu_compat

    cfg = tiny_recipe(2)
    _, model = _provider(hf_dir, load_weights=True)
    model.seq_length, model.context_parallel_size = SEQ, 2
    cfg.model = model
    cfg.dataset.seq_length, cfg.tokenizer.vocab_size = SEQ, VOCAB
    cfg.train.train_iters, cfg.scheduler.lr_warmup_iters = STEPS, 0
    cfg.optimizer.lr = cfg.optimizer.min_lr = 1e-2  # a visible change of every weight in 2 steps
    cfg.checkpoint.save, cfg.checkpoint.save_interval = save, STEPS
    cfg = configure(cfg, cp_algorithm="ring")
    with cpu_compat.enabled():
        pretrain(cfg, gpt_step.forward_step)
    parallel_state.destroy_model_parallel()


def _export_and_compare(hf_dir: str, save: str, out: str) -> dict:
    """Rank body (1 rank): load the saved model with Bridge, export it to HF, and compare logits."""
    import_bridge()
    import torch
    from megatron.bridge.training.model_load_save import load_megatron_model
    from megatron.core import parallel_state
    from transformers import LlamaForCausalLM

    from megatron_longctx.bridge.spec import allow_in_run_config
    from megatron_longctx.megatron import cpu_compat

    allow_in_run_config()
    bridge, _ = _provider(hf_dir, load_weights=False)
    parallel_state.initialize_model_parallel()
    with cpu_compat.enabled():
        models = load_megatron_model(f"{save}/iter_{STEPS:07d}", use_cpu_init=True, skip_temp_dist_context=True)
        models = models if isinstance(models, list) else [models]
        bridge.save_hf_pretrained(models, out, show_progress=False)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))  # [b, s]
        positions = torch.arange(SEQ).expand(2, SEQ)
        megatron = models[0].eval()
        with torch.no_grad():
            ours = megatron(tokens, positions, None).double()  # [b, s, vocab]
    parallel_state.destroy_model_parallel()
    exported = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    imported = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = exported(tokens).logits.double()  # [b, s, vocab]
        before = imported(tokens).logits.double()
    moved = {name: float((p - imported.state_dict()[name]).abs().max()) for name, p in exported.state_dict().items()}
    return {"ours": ours, "theirs": theirs, "before": before, "moved": moved}


def test_hf_llama_imported_trained_at_cp2_exported_has_megatrons_logits(tmp_path):
    pytest.importorskip("transformers")
    hf_dir, save, out = str(tmp_path / "hf"), str(tmp_path / "megatron"), str(tmp_path / "exported")
    _write_hf_llama(hf_dir)
    run_ranks(2, _train, hf_dir, save)
    model = __import__("omegaconf").OmegaConf.load(f"{save}/iter_{STEPS:07d}/run_config.yaml").model
    assert (model.context_parallel_size, model.seq_length) == (2, SEQ)  # trained at CP=2, past the HF model's 32
    spec = model.transformer_layer_spec
    assert spec._target_ == "megatron_longctx.bridge.spec.LongContextLayerSpec" and spec.options.cp_algorithm == "ring"
    (result,) = run_ranks(1, _export_and_compare, hf_dir, save, out)
    torch = pytest.importorskip("torch")
    torch.testing.assert_close(result["theirs"], result["ours"], rtol=1e-5, atol=1e-5)
    assert min(result["moved"].values()) > 0, result["moved"]  # every exported weight is the trained one
    assert (result["theirs"] - result["before"]).abs().max() > 1e-3  # and the logits are not the imported model's
