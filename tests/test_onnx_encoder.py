"""Encoder (BERT-style) export: torch.onnx + ONNX Runtime dynamic int8, checked by sentence-embedding
cosine similarity against torch, on a tiny random BERT (tests/tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import make_text, run_cli
from tests.tiny import tiny_bert_dir

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'compress[onnx]')")
pytestmark = pytest.mark.runtime  # torch.onnx and ONNX Runtime


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert_dir(tmp_path_factory.mktemp("bert") / "tiny-bert", [make_text(s, 20) for s in range(3)])


def test_encoder_exports_to_onnx_and_int8_with_embeddings_that_match(tmp_path: Path, tiny_bert: Path) -> None:
    out = tmp_path / "enc"
    result = run_cli(["export-encoder", tiny_bert, "-o", out])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "encoder_report.json").read_text())
    fp32, int8 = report["checks"]["model.onnx"], report["checks"]["model.int8.onnx"]
    assert fp32["min_cosine"] > 0.99999 and 0.99 < int8["min_cosine"] < 1.0, report
    assert int8["size_bytes"] < 0.7 * fp32["size_bytes"]  # MatMul weights int8; the tiny vocabulary stays float
    assert report["inputs"] == ["input_ids", "attention_mask"]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_an_int8_file_below_the_required_similarity_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    out = tmp_path / "enc"
    result = run_cli(["export-encoder", tiny_bert, "-o", out, "--min-cosine-int8", "1.0"])  # int8 weights cannot reach 1
    assert result.exit_code == 2 and "below the required 1.0" in result.output and not out.exists()


def test_decoders_are_sent_to_recipes(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = run_cli(["export-encoder", tiny_model_dir, "-o", tmp_path / "x"])
    assert result.exit_code == 2 and "format: onnx" in result.output
