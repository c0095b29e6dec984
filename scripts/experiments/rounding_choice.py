"""Per layer, which rounding of a llama.cpp type's grid leaves the smallest layer-output error on
calibration text: our round-to-nearest with the grid search (quantizers/grid_search.py), our GPTQ on
the same grid, or llama.cpp's own quantizer (``llama-quantize --pure`` of our F16 GGUF, read back with
gguf-py). The error is GPTQ's objective, ½ tr(ΔW H ΔWᵀ) with H = 2/n Σ x xᵀ of the layer's inputs in
the unquantized model, relative to ½ tr(W H Wᵀ).

    python scripts/experiments/rounding_choice.py -o DIR [--model reference:qwen2.5-coder-1.5b] [--blocks 0,9,18,27]
        [--types q4_k,q6_k] [--cal 8x512] [--threads 2]

Writes DIR/f16.gguf and DIR/llama.TYPE.gguf once (reused on a later run), prints a table per type and
writes DIR/rounding-choice.json. It answers whether a per-layer choice between the roundings can beat
GPTQ alone on a model that was distributed already quantized (its weights sit on a source grid that
a rounding can find again and GPTQ's error feedback can leave).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from compress import streaming  # noqa: E402
from compress.eval.bench.quant import load_bench_inputs  # noqa: E402
from compress.export.gguf import runtime as gguf_runtime  # noqa: E402
from compress.export.gguf.inputs import is_gguf_file  # noqa: E402
from compress.export.gguf.writer import write_gguf  # noqa: E402
from compress.progress import Reporter  # noqa: E402
from compress.quantizers.gptq import accumulate_hessian, gptq_quantize  # noqa: E402
from compress.quantizers.grid_search import grid_quantize  # noqa: E402
from compress.schema.quantize import QuantScheme  # noqa: E402
from compress.schema.recipe import DataConfig  # noqa: E402

TEXT = "reference:shakespeare"
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hessians(model: torch.nn.Module, tokens: torch.Tensor, blocks: list[int]) -> dict[str, torch.Tensor]:
    """2/n Σ x xᵀ of the inputs of every Linear of ``blocks``, in the unquantized model."""
    found: dict[str, torch.Tensor] = {}
    count: dict[str, int] = {}

    def hook(name: str):
        def fn(_m, args, _out):
            width = args[0].shape[-1]
            h = found.setdefault(name, torch.zeros(width, width))
            count[name] = accumulate_hessian(h, count.get(name, 0), args[0].detach())

        return fn

    handles = []
    for b in blocks:
        for sub in GGUF_NAMES:
            name = f"model.layers.{b}.{sub}"
            handles.append(model.get_submodule(name).register_forward_hook(hook(name)))
    with torch.no_grad():
        for row in tokens:
            model(row.unsqueeze(0))
    for h in handles:
        h.remove()
    return found


def objective(dw: torch.Tensor, h: torch.Tensor) -> float:
    return 0.5 * float(((dw @ h) * dw).sum())


def llama_weight(reader, name: str, shape: tuple[int, int]) -> torch.Tensor:
    import gguf

    t = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))


def main() -> None:
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--model", default="reference:qwen2.5-coder-1.5b")
    ap.add_argument("--blocks", default="0,9,18,27")
    ap.add_argument("--types", default="q4_k,q6_k")
    ap.add_argument("--cal", default="8x512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    reporter = Reporter()
    samples, _, seq_len = args.cal.partition("x")
    data = DataConfig(
        calibration={"source": TEXT, "samples": int(samples), "seq_len": int(seq_len)},
        evaluation={"source": TEXT, "samples": 1, "seq_len": 64},
    )
    lm, calibration, _, _ = load_bench_inputs(args.model, data, args.threads, reporter)
    model = lm.model.eval()
    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "f16.gguf"
    if not f16.is_file():
        tokenizer_from = lm.source_path if is_gguf_file(lm.source_path) else None
        write_gguf(f16, model, lm.tokenizer, {}, "f16", tokenizer_from=tokenizer_from)
    types = args.types.split(",")
    readers = {}
    for t in types:
        path = out / f"llama.{t}.gguf"
        if not path.is_file():
            gguf_runtime.quantize(f16, path, t, args.threads, token_embedding_type="q8_0", pure=True)
        readers[t] = gguf.GGUFReader(path)
    blocks = [int(b) for b in args.blocks.split(",")]
    hs = hessians(model, calibration.tokens, blocks)
    rows = []
    for name, h in hs.items():
        block = model.get_submodule(name.rsplit(".", 2)[0])
        with streaming.resident(block):
            w = model.get_submodule(name).weight.detach().float().clone()
        b, sub = name.split(".")[2], name.split(".", 3)[3]
        base = objective(w, h)
        for t in types:
            scheme = QuantScheme(gguf_type=t)
            rtn = grid_quantize(w, scheme).dequantize().float()
            gptq, _ = gptq_quantize(w, h, scheme)
            theirs = llama_weight(readers[t], f"blk.{b}.{GGUF_NAMES[sub]}.weight", tuple(w.shape))
            row = {"layer": name, "type": t}
            for label, q in (("rtn", rtn), ("gptq", gptq.dequantize().float()), ("llama.cpp", theirs)):
                row[label] = objective(w - q, h) / base
            rows.append(row)
            print(f"{name:34s} {t:5s} rtn {row['rtn']:.3e}  gptq {row['gptq']:.3e}  llama.cpp {row['llama.cpp']:.3e}", flush=True)
    for t in types:
        sel = [r for r in rows if r["type"] == t]
        best = sum(min(r["rtn"], r["gptq"]) for r in sel)
        print(
            f"{t}: sums over {len(sel)} layers: rtn {sum(r['rtn'] for r in sel):.3e}, gptq {sum(r['gptq'] for r in sel):.3e}, "
            f"llama.cpp {sum(r['llama.cpp'] for r in sel):.3e}, best of rtn/gptq {best:.3e}"
        )
    (out / "rounding-choice.json").write_text(json.dumps({"model": args.model, "cal": args.cal, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
