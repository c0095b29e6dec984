"""Text sources and chunking: deterministic, calibration and evaluation kept apart, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from compress.data import DataPlan, bos_prefix, load_source, role_blocks, split_blocks
from compress.errors import AssetError, DataError
from compress.schema.recipe import DataConfig
from tests.helpers import make_text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def data_config(cal: str | None, ev: str | None, **kw) -> DataConfig:
    data = {}
    if cal:
        data["calibration"] = {"source": cal, "samples": kw.get("cal_samples", 8), "seq_len": 64, "seed": kw.get("cal_seed", 0)}
    if ev:
        data["evaluation"] = {"source": ev, "samples": kw.get("ev_samples", 8), "seq_len": 64, "seed": kw.get("ev_seed", 0)}
    return DataConfig(**data)


def test_chunks_are_deterministic_and_seeded(text_dir: Path, tokenizer) -> None:
    a = DataPlan.load(data_config(None, str(text_dir)), Path.cwd()).chunks("evaluation", tokenizer)
    b = DataPlan.load(data_config(None, str(text_dir)), Path.cwd()).chunks("evaluation", tokenizer)
    c = DataPlan.load(data_config(None, str(text_dir), ev_seed=1), Path.cwd()).chunks("evaluation", tokenizer)
    assert a.tokens.shape == (8, 64)
    assert a.sha256 == b.sha256
    assert a.sha256 != c.sha256


def test_calibration_and_evaluation_text_do_not_overlap(text_dir: Path) -> None:
    plan = DataPlan.load(data_config(str(text_dir), str(text_dir)), Path.cwd())
    assert len(plan.shared) == 3
    docs = plan.evaluation_source.documents
    cal = set(role_blocks(docs, plan.shared, "calibration", 0.2))
    ev = set(role_blocks(docs, plan.shared, "evaluation", 0.2))
    assert cal and ev and not (cal & ev)
    all_blocks = [b for d in docs for b in split_blocks(d.text)]
    assert len(cal) + len(ev) == len(set(all_blocks))
    assert 0.05 < len(ev) / len(all_blocks) < 0.45


def test_evaluation_chunks_do_not_depend_on_calibration_settings(text_dir: Path, tokenizer) -> None:
    a = DataPlan.load(data_config(str(text_dir), str(text_dir)), Path.cwd()).chunks("evaluation", tokenizer)
    b = DataPlan.load(data_config(str(text_dir), str(text_dir), cal_seed=7, cal_samples=2), Path.cwd()).chunks("evaluation", tokenizer)
    assert a.sha256 == b.sha256


def test_unshared_documents_are_used_whole(tmp_path: Path, text_dir: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text(make_text(99, 40))
    plan = DataPlan.load(data_config(str(other), str(text_dir)), Path.cwd())
    assert plan.shared == set()
    ev = role_blocks(plan.evaluation_source.documents, plan.shared, "evaluation", 0.2)
    assert len(ev) == sum(len(split_blocks(d.text)) for d in plan.evaluation_source.documents)


def test_sources_file_dir_glob_jsonl(tmp_path: Path, text_dir: Path) -> None:
    assert len(load_source(str(text_dir / "doc0.txt"), Path.cwd()).documents) == 1
    assert len(load_source(str(text_dir), Path.cwd()).documents) == 3
    assert len(load_source("doc[01].txt", text_dir).documents) == 2  # relative glob against the base dir
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"body": make_text(i, 2)}) for i in range(4)) + "\n")
    docs = load_source(str(jl), Path.cwd(), text_field="body").documents
    assert [d.id for d in docs] == ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3", "d.jsonl:4"]


@pytest.mark.parametrize(
    ("content", "field", "expected"),
    [
        ('{"text": "ok"}\nnot json\n', "text", "d.jsonl:2: not valid JSON"),
        ('{"body": "ok"}\n', "text", "d.jsonl:1: record has no string field 'text'"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, field: str, expected: str) -> None:
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=expected):
        load_source(str(tmp_path / "d.jsonl"), Path.cwd(), text_field=field)


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_source("nope/", tmp_path)
    with pytest.raises(DataError, match="matches no"):
        load_source("*.md", tmp_path)
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(DataError, match="holds no text"):
        load_source(str(tmp_path / "blank.txt"), tmp_path)
    with pytest.raises(AssetError, match="not a reference text; known: reference:shakespeare, reference:python-docs"):
        load_source("reference:smollm2-135m", tmp_path)


def test_too_little_text_says_what_to_change(tmp_path: Path, tokenizer) -> None:
    (tmp_path / "small.txt").write_text(make_text(1, 3))
    plan = DataPlan.load(data_config(None, str(tmp_path / "small.txt"), ev_samples=500), Path.cwd())
    with pytest.raises(DataError, match=r"500 chunks need .* Lower data.evaluation.samples"):
        plan.chunks("evaluation", tokenizer)


def test_bos_prefix_detection(tokenizer) -> None:
    assert bos_prefix(tokenizer) == []  # the tiny tokenizer adds nothing

    class WithBos:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([7] if add_special_tokens else []) + [ord(c) for c in text]}

    assert bos_prefix(WithBos()) == [7]
