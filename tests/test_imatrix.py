"""llama.cpp's importance matrix from GPTQ's calibration pass (quantizers/gptq.py input_square_sums,
export/gguf/imatrix.py): the sums are those of the inputs, the file is llama.cpp's GGUF layout."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from compress.context import RunContext
from compress.errors import FormatError
from compress.export.gguf.imatrix import IMATRIX_FILE, read_imatrix, write_imatrix
from compress.progress import Reporter
from compress.quantizers.configs import GPTQConfig
from compress.quantizers.gptq import GPTQStage, accumulate_hessian, input_square_sums, mirror_upper
from tests.helpers import recipe_text, run_cli, write_recipe
from tests.tiny import tiny_llama

QUIET = Reporter(quiet=True)


def test_the_hessians_diagonal_gives_each_input_columns_sum_of_squares() -> None:
    x = torch.randn(4, 70, 40, dtype=torch.bfloat16)
    h, n = torch.zeros(40, 40), 0
    for part in x:
        n = accumulate_hessian(h, n, part, upper_only=True)
    mirror_upper(h)
    expected = x.float().reshape(-1, 40).double().pow(2).sum(0).float()
    assert n == 280
    torch.testing.assert_close(input_square_sums(h, n), expected, rtol=1e-5, atol=1e-5)


def test_gptq_keeps_what_each_linear_saw_and_the_file_holds_it_under_llama_cpps_names(tmp_path: Path) -> None:
    model = tiny_llama(300, hidden=64, intermediate=128).eval()
    tokens = torch.randint(0, 300, (6, 32), generator=torch.Generator().manual_seed(0))
    seen: dict[str, torch.Tensor] = {}  # block 0's inputs are the unquantized model's: summed here independently
    hooks = [
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", a[0].detach().clone())),
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("down", a[0].detach().clone())),
    ]
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)
    GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, ctx)
    assert len(ctx.input_sums) == 14 and all(count == tokens.numel() for _, count in ctx.input_sums.values())
    for key, name in (("q", "model.layers.0.self_attn.q_proj"), ("down", "model.layers.0.mlp.down_proj")):
        expected = seen[key].reshape(-1, seen[key].shape[-1]).double().pow(2).sum(0).float()
        torch.testing.assert_close(ctx.input_sums[name][0], expected, rtol=1e-4, atol=1e-4)

    expert = "model.layers.0.mlp.experts.3.gate_proj"  # llama.cpp holds experts as one 3-D tensor: no entry of its own
    narrowed = "model.layers.1.mlp.down_proj"  # as if a later stage had pruned its inputs to 100: llama.cpp would refuse it
    changed = {**ctx.input_sums, narrowed: (torch.ones(100), 192), expert: (torch.ones(64), 5)}
    assert write_imatrix(tmp_path / "changed.gguf", model, changed, ["t"], 32)["not_written"] == [narrowed, expert]
    assert len(read_imatrix(tmp_path / "changed.gguf")[0]) == 13
    facts = write_imatrix(tmp_path / IMATRIX_FILE, model, {**ctx.input_sums, expert: (torch.ones(64), 5)}, ["reference:shakespeare"], 32)
    assert facts["tensors"] == 14 and facts["tokens"] == 192 and facts["not_written"] == [expert]
    only_experts = write_imatrix(tmp_path / "none.gguf", model, {expert: (torch.ones(64), 5)}, ["t"], 32)
    assert only_experts["file"] is None and only_experts["not_written"] == [expert] and not (tmp_path / "none.gguf").exists()
    back, meta = read_imatrix(tmp_path / IMATRIX_FILE)
    assert meta == {"datasets": ["reference:shakespeare"], "chunk_size": 32, "chunk_count": 6}
    assert sorted(back) == sorted(
        f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )
    assert np.array_equal(back["blk.0.attn_q.weight"][0], ctx.input_sums["model.layers.0.self_attn.q_proj"][0].numpy())
    assert np.array_equal(back["blk.0.attn_q.weight"][0], back["blk.0.attn_v.weight"][0])  # one input, as llama.cpp records it
    assert back["blk.1.ffn_down.weight"][0].shape == (128,) and back["blk.1.ffn_down.weight"][1] == 192.0
    # llama.cpp's layout: general.type imatrix; by weight name in sorted order, <name>.in_sum2 [in, 1] then <name>.counts [1, 1], float32
    reader = gguf.GGUFReader(tmp_path / IMATRIX_FILE)
    names = [t.name for t in reader.tensors]
    weights = [n.rsplit(".", 1)[0] for n in names[::2]]
    assert weights == sorted(weights) and names[:2] == ["blk.0.attn_k.weight.in_sum2", "blk.0.attn_k.weight.counts"]
    sums = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight.in_sum2")
    assert sums.tensor_type == gguf.GGMLQuantizationType.F32 and list(sums.shape) == [128, 1]


def test_a_file_that_is_no_imatrix_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_tensor("x", np.zeros((1, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match="not an importance matrix"):
        read_imatrix(tmp_path / "m.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00 truncated")
    with pytest.raises(FormatError, match="not a readable imatrix GGUF"):
        read_imatrix(tmp_path / "junk.gguf")


def test_a_gptq_run_writes_the_importance_matrix_beside_its_gguf(tmp_path: Path, tiny_model_dir: Path, text_dir: Path) -> None:
    text = recipe_text(tiny_model_dir, text_dir).replace("method: rtn", "method: gptq")
    text = text.replace("exports: []\n", "exports:\n  - format: gguf\n    name: q4\n    type: q4_0\n    verify: false\n")
    out = tmp_path / "out"
    result = run_cli(["run", write_recipe(tmp_path, text), "-o", out])
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["exports"][0]
    facts = entry["importance"]
    assert facts["file"] == IMATRIX_FILE and facts["tensors"] == 14 and IMATRIX_FILE in entry["files"]
    back, meta = read_imatrix(out / "exports" / "q4" / IMATRIX_FILE)
    assert len(back) == 14 and meta["chunk_count"] * meta["chunk_size"] == facts["tokens"]
    assert all(np.isfinite(s).all() and (s >= 0).all() and s.sum() > 0 for s, _ in back.values())


@pytest.mark.runtime
def test_llama_cpps_own_quantizer_loads_our_importance_matrix(tmp_path: Path, tiny_model_dir: Path) -> None:
    """llama-quantize (built from the llama.cpp the binding vendors) reads every entry of our file."""
    import subprocess

    from transformers import AutoTokenizer

    from compress.export.gguf.tools import llama_tool
    from compress.export.gguf.writer import write_gguf

    quantize = llama_tool("llama-quantize")
    if quantize is None:
        pytest.skip("llama.cpp's tools are not built here (python scripts/build_llama_tools.py, about 10 minutes on 2 cores)")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = tiny_llama(len(tokenizer), hidden=256, intermediate=512).eval()
    f16 = tmp_path / "f16.gguf"
    write_gguf(f16, model, tokenizer, {}, "f16")
    tokens = torch.randint(0, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(0))
    ctx = RunContext(seed=0, device=torch.device("cpu"), tokenizer=None, reporter=QUIET, calibration=lambda: tokens)
    GPTQStage(GPTQConfig(bits=4, group_size=32), "stages[0]").apply(model, ctx)
    write_imatrix(tmp_path / IMATRIX_FILE, model, ctx.input_sums, ["test text"], 64)
    done = subprocess.run(
        [str(quantize), "--imatrix", str(tmp_path / IMATRIX_FILE), str(f16), str(tmp_path / "q4_k_m.gguf"), "Q4_K_M", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stdout + done.stderr
    assert f"loaded 14 importance matrix entries from {tmp_path / IMATRIX_FILE} computed on 4 chunks" in log, log[-3000:]
    assert "imatrix datasets=['test text']" in log
