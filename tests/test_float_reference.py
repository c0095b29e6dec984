"""Float references (issue 53, item 1): the same function as the distributed model, and no block grid
left for a quantizer to find again."""

from __future__ import annotations

import pytest
import torch

from compress.float_reference import float_reference, grid_share, ongrid_blocks
from tests.tiny import tiny_model


def _on_a_4bit_grid(model: torch.nn.Module) -> None:
    """Every Linear rounded to an affine 4-bit grid per 32 values, the norms made uneven: a model as
    distributed quantized."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                rows, cols = module.weight.shape
                blocks = module.weight.reshape(rows, cols // 32, 32)
                low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
                step = (high - low) / 15
                module.weight.copy_((((blocks - low) / step).round() * step + low).reshape(rows, cols))
            elif name.endswith("norm"):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(len(name))))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("untie", [False, True])
def test_the_float_reference_keeps_the_function_and_leaves_no_grid(family: str, untie: bool) -> None:
    model = tiny_model(family, tie=True).float().eval()
    _on_a_4bit_grid(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    assert all(grid_share(m.weight) == 1.0 for m in model.modules() if isinstance(m, torch.nn.Linear))
    facts = float_reference(model, untie=untie)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() < 1e-5 * before.abs().max()
    linears = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (untie or n != "lm_head")}
    assert max(grid_share(w) for w in linears.values()) == 0.0, {n: grid_share(w) for n, w in linears.items()}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (not untie) == facts["tied"]
    assert model.config.tie_word_embeddings == (not untie)
    if untie:  # the rotation takes the embedding off its grid too
        assert grid_share(model.model.embed_tokens.weight) == 0.0
    assert all(bool((layer.input_layernorm.weight == 1).all()) for layer in model.model.layers)


@pytest.mark.unit
def test_the_grid_check_sees_each_grid_and_nothing_else() -> None:
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(1, 15, (8, 64), generator=generator).float()  # extremes 0 and 15 unused: as K-quants' searches leave them
    scales, mins = torch.rand(8, 2, 1, generator=generator) + 0.1, torch.randn(8, 2, 1, generator=generator)
    q4 = (codes.reshape(8, 2, 32) * scales + mins).reshape(8, 64)
    assert bool(ongrid_blocks(q4, 32, levels=16).all()) and grid_share(q4) == 1.0
    codes6 = torch.randint(-32, 32, (8, 64), generator=generator).float()
    halves = (codes6.reshape(8, 4, 16) * torch.rand(8, 4, 1, generator=generator)).reshape(8, 64)  # Q6_K-like: a scale per 16
    assert grid_share(halves) == 1.0 and not bool(ongrid_blocks(halves, 32).any())
    assert grid_share(torch.randn(8, 64, generator=generator)) == 0.0
    q8 = torch.randint(-128, 128, (8, 64), generator=generator).float() * 0.01  # an 8-bit grid is not a 4-6-bit one
    assert grid_share(q8) == 0.0
    as_bf16 = torch.randn(8, 64, generator=generator).to(torch.bfloat16).float()
    assert grid_share(as_bf16) == 0.0


@pytest.mark.slow
@pytest.mark.real_model
def test_the_smollm2_float_references_match_the_distributed_model(smollm2) -> None:
    from transformers import AutoModelForCausalLM

    from compress import assets

    distributed = smollm2.model  # the session's reference model in float32 (converted from its GGUF once)
    ids = torch.randint(0, distributed.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = distributed(ids).logits
    on_grid = [grid_share(m.weight) for n, m in distributed.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert min(on_grid) > 0.99  # Q4_1 as distributed: every block on its grid
    for name, tied in (("smollm2-135m-float", True), ("smollm2-135m-float-untied", False)):
        asset = assets.locate(name)
        assert asset is not None, f"run `compress assets fetch` ({name} is a default asset)"
        model = AutoModelForCausalLM.from_pretrained(asset.path, dtype=torch.float32).eval()
        assert model.config.tie_word_embeddings == tied
        with torch.no_grad():
            logits = model(ids).logits
        assert (logits - reference).abs().max() < 5e-4, name  # measured 6e-5 (tied) and 9e-5 (untied) of logits up to 34
        shares = [grid_share(m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (not tied or n != "lm_head")]
        assert max(shares) == 0.0, name
