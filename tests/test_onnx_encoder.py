"""Encoder (BERT-style) export: torch.onnx + ONNX Runtime dynamic int8, checked by sentence-embedding
cosine similarity against torch, on a tiny random BERT built from a config in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import make_text, run_cli

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'compress[onnx]')")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("bert") / "tiny-bert"
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([make_text(s, 20) for s in range(3)], trainers.WordPieceTrainer(vocab_size=300, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                        sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, architectures=["BertModel"])
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_encoder_exports_to_onnx_and_int8_with_embeddings_that_match(tmp_path: Path, tiny_bert: Path) -> None:
    out = tmp_path / "enc"
    result = run_cli(["export-encoder", tiny_bert, "-o", out])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "encoder_report.json").read_text())
    fp32, int8 = report["checks"]["model.onnx"], report["checks"]["model.int8.onnx"]
    assert fp32["min_cosine"] > 0.99999 and 0.99 < int8["min_cosine"] < 1.0, report
    assert int8["size_bytes"] < 0.7 * fp32["size_bytes"]  # MatMul weights int8; the tiny vocabulary stays float and report["inputs"] == ["input_ids", "attention_mask"]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_an_int8_file_below_the_required_similarity_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    out = tmp_path / "enc"
    result = run_cli(["export-encoder", tiny_bert, "-o", out, "--min-cosine-int8", "1.0"])  # int8 weights cannot reach 1
    assert result.exit_code == 2 and "below the required 1.0" in result.output and not out.exists()


def test_decoders_are_sent_to_recipes(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = run_cli(["export-encoder", tiny_model_dir, "-o", tmp_path / "x"])
    assert result.exit_code == 2 and "format: onnx" in result.output
