"""The activation estimate of notebook 06 (helpers.long_context) against what autograd really keeps for backward,
for each technique, on a small Llama built from its config (CPU, bf16 and fp32), and the tiled paths' numbers."""
import pytest
import torch

import helpers
from helpers.long_context import estimate_saved_activations, long_context_shape, saved_activation_bytes

CONFIG = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=4000, max_position_embeddings=4096, attn_implementation="sdpa")


def _model(dtype, checkpointing=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


@pytest.mark.parametrize("dtype, e", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("technique", ["plain", "checkpointing", "tiled_mlp", "tiled_logits"])
def test_the_estimate_is_what_autograd_keeps(dtype, e, technique):
    from transformers import LlamaConfig

    shape = long_context_shape(LlamaConfig(**CONFIG))
    model = _model(dtype, checkpointing=technique == "checkpointing")
    for seq_len in (256, 1024):
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len))
        if technique == "tiled_logits":
            def forward():
                return helpers.tiled_causal_lm_loss(model, ids, tile_tokens=128)
        else:
            def forward():
                return model(input_ids=ids, labels=ids).loss
        with helpers.tiled_mlp() if technique == "tiled_mlp" else torch.enable_grad():
            kept, loss = saved_activation_bytes(forward, exclude=model.parameters())
            loss.backward()
        est = estimate_saved_activations(shape, seq_len, precision_bytes=e,
                                         **({} if technique == "plain" else {technique: True}))
        assert est.gpu_total == pytest.approx(kept, rel=0.005), (technique, seq_len, est.table())


def test_the_tiled_paths_give_the_models_own_loss_and_gradients():
    model = _model(torch.float32)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 512))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with helpers.tiled_mlp(tile_tokens=100):  # 6 slices, the last one short
        tiled = helpers.tiled_causal_lm_loss(model, ids, tile_tokens=73)  # 511 positions = 7 equal slices
    tiled.backward()
    assert tiled.item() == pytest.approx(loss.item(), rel=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n
    from transformers.models.llama import modeling_llama
    assert modeling_llama.LlamaMLP.forward.__qualname__ == "LlamaMLP.forward"  # restored on leaving


def test_checkpointing_and_its_offload_move_the_same_bytes_and_the_vocabulary_dominates_the_head():
    from transformers import LlamaConfig

    shape = long_context_shape(LlamaConfig(**{**CONFIG, "vocab_size": 32000, "hidden_size": 1024,
                                             "intermediate_size": 2816, "num_hidden_layers": 16,
                                             "num_attention_heads": 16, "num_key_value_heads": 4}))
    ckpt = estimate_saved_activations(shape, 8192, checkpointing=True)
    off = estimate_saved_activations(shape, 8192, checkpointing=True, offload_checkpoints=True)
    assert off.cpu_total == ckpt.gpu["layer inputs (checkpoints)"] and off.gpu_total == ckpt.gpu_total - off.cpu_total
    assert ckpt.gpu["loss: log-softmax (fp32)"] > ckpt.gpu["layer inputs (checkpoints)"]  # 4 x 32000 > 16 x 2 x 1024
    tiled = estimate_saved_activations(shape, 8192, checkpointing=True, tiled_logits=True)
    assert "loss: log-softmax (fp32)" not in tiled.gpu and tiled.gpu_total < ckpt.gpu_total / 3
    with pytest.raises(ValueError, match="pass checkpointing=True"):
        estimate_saved_activations(shape, 8192, offload_checkpoints=True)
    with pytest.raises(ValueError, match="seq_len must be a positive whole number"):
        estimate_saved_activations(shape, 0)
