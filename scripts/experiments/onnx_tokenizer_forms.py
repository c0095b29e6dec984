"""How ONNX Runtime GenAI tokenizes an ONNX export's tokenizer.json in each way of writing its
pre-tokenizer, against the source's Hugging Face tokenizer, on the parity corpus (200 KB of mixed
text, export/parity.py) plus a few non-ASCII numerals.

    python scripts/experiments/onnx_tokenizer_forms.py OUT/exports/int4 --source OUT/model

For each form (``as-written``: the export's file; ``digits+bytelevel``: SmolLM's Digits then
ByteLevel with its regex; ``two-splits``: what export/onnx/builder.py normalize_tokenizer writes for
it), prints how many texts Hugging Face tokenizers and ONNX Runtime GenAI tokenize differently from
the source tokenizer. Informs the Digits rewrite in normalize_tokenizer (measured on SmolLM2: GenAI
differed on 57 of 148 texts with Digits + ByteLevel, on none with the two Splits).
The export directory is copied; the original is not changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

EXTRA_TEXTS = ["x  \u0663\u0664 and  \u00b2  \u00bd \u216b  \u3007 \uff15\uff16 end", "a \u0663 b\t\u0664"]


def forms(byte_level: dict) -> dict[str, dict | None]:
    from compress.export.onnx.builder import GPT2_REGEX

    plain = {**byte_level, "use_regex": True}
    return {
        "as-written": None,
        "digits+bytelevel": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, plain]},
        "two-splits": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\p{N}"}, "behavior": "Isolated", "invert": False},
                {"type": "Split", "pattern": {"Regex": GPT2_REGEX}, "behavior": "Isolated", "invert": False},
                {**byte_level, "use_regex": False},
            ],
        },
    }


def main() -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from compress.export.onnx import runtime as rt
    from compress.export.parity import parity_corpus, tokenization_mismatches

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="an ONNX export directory (genai_config.json, tokenizer.json, model.onnx)")
    parser.add_argument("--source", type=Path, required=True, help="the source's Hugging Face tokenizer directory (the truth)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    truth = AutoTokenizer.from_pretrained(args.source)
    texts = [*parity_corpus(truth), *EXTRA_TEXTS]
    written = json.loads((args.export / "tokenizer.json").read_text())
    pres = written["pre_tokenizer"].get("pretokenizers", [written["pre_tokenizer"]])
    byte_level = next(p for p in pres if p.get("type") == "ByteLevel")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pre in forms(byte_level).items():
            work = Path(tmp) / name
            shutil.copytree(args.export, work)
            data = dict(written)
            if pre is not None:
                data["pre_tokenizer"] = pre
            (work / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
            hf = Tokenizer.from_str(json.dumps(data))
            hf_bad = sum(hf.encode(t, add_special_tokens=False).ids != truth(t, add_special_tokens=False)["input_ids"] for t in texts)
            with rt.GenAIModel(work, args.threads) as genai:
                ort_bad = len(tokenization_mismatches(genai.encode, truth, texts, "onnxruntime-genai", add_special_tokens=True))
            results[name] = {"texts": len(texts), "huggingface_differ": hf_bad, "onnxruntime_genai_differ": ort_bad}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
