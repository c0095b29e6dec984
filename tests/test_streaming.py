"""Models streamed from disk (compress/streaming.py), the baseline's cached hidden states
(eval/baseline.py), chunked scoring (eval/metrics.py) and records kept on disk (RecordStore)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress import streaming
from compress.eval import metrics
from compress.eval.baseline import CachedBaseline, RememberedRows, head_read_from_disk
from compress.eval.metrics import compare, torch_forward
from compress.models import load_model
from compress.progress import Reporter
from compress.quantizers.core import RecordStore
from compress.quantizers.rtn import rtn_quantize
from compress.schema.quantize import QuantScheme
from compress.schema.recipe import ModelConfig

CPU = torch.device("cpu")
QUIET = Reporter(quiet=True)


def ids(n: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 200, (n, seq), generator=torch.Generator().manual_seed(seed))


def resident_tensors(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.device.type != "meta"]


def test_a_streamed_model_computes_what_the_loaded_model_computes_and_holds_no_unit_after(tiny_model_dir: Path) -> None:
    lm = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET)
    model = lm.model
    assert lm.facts["streamed"] == "streamed from the checkpoint" and lm.facts["dtype"] == "float32"
    assert resident_tensors(model) == []  # nothing read yet
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    x = ids()
    with torch.no_grad():
        got = model(input_ids=x, use_cache=False).logits
        want = reference(input_ids=x, use_cache=False).logits
    assert torch.equal(got, want)
    assert resident_tensors(model) == []  # every unit dropped after its forward
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ties survive loading and dropping
    names = [n for n, _ in streaming.units(model)]
    assert sorted(names) == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]


def test_changes_go_to_the_overlay_and_a_fork_made_before_does_not_see_them(tiny_model_dir: Path) -> None:
    baseline = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model
    work = copy.deepcopy(baseline)
    block = work.model.layers[0]
    with streaming.resident(block, CPU, write_back=True):
        block.mlp.down_proj.weight.mul_(0.0)
    assert resident_tensors(work) == []
    with streaming.resident(block, CPU):
        assert float(block.mlp.down_proj.weight.abs().sum()) == 0.0  # read back from the overlay
    with streaming.resident(baseline.model.layers[0], CPU):
        assert float(baseline.model.layers[0].mlp.down_proj.weight.abs().sum()) > 0  # the source is untouched
    source_files = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert source_files == {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}


def test_materialize_gives_an_ordinary_model(tiny_model_dir: Path) -> None:
    model = streaming.materialize(load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model)
    assert not streaming.is_streamed(model) and len(resident_tensors(model)) == len(list(model.parameters()))
    model.to(torch.float64)  # an in-memory model moves like any other


def test_auto_dtype_is_the_checkpoints_and_an_explicit_dtype_wins(tmp_path: Path, tiny_model_dir: Path) -> None:
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in tiny_model_dir.glob("tokenizer*"):
        shutil.copy(f, bf16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    auto = load_model(ModelConfig(source=str(bf16)), Path("."), QUIET)
    assert auto.model.dtype == torch.bfloat16 and auto.facts["dtype"] == "bfloat16"
    wide = load_model(ModelConfig(source=str(bf16), dtype="float32"), Path("."), QUIET)
    assert wide.model.dtype == torch.float32
    with streaming.resident(wide.model.model.layers[0], CPU):
        assert wide.model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_the_cached_baseline_equals_a_live_pass_and_computes_each_row_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model
    cached = CachedBaseline(model, CPU, tmp_path / "baseline", "sha")
    x = ids(3)
    live = torch_forward(model, CPU)(x).full()
    assert torch.equal(cached(x).full(), live) and (cached.computed, cached.reused) == (3, 0)
    assert torch.equal(cached(x[1:]).full(), live[1:]) and (cached.computed, cached.reused) == (3, 2)
    scores = compare(cached, {"same": torch_forward(model, CPU)}, x, 4)
    assert scores["same"]["kl_divergence"] == pytest.approx(0.0, abs=1e-9) and scores["same"]["top1_agreement"] == 1.0


def test_remembered_rows_serve_the_same_weights_check_without_another_pass(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model
    remembered = RememberedRows(model, CPU, limit=2)
    x = ids(3)
    live = torch_forward(model, CPU)(x).full()
    assert torch.equal(remembered(x).full(), live) and (remembered.computed, remembered.reused) == (3, 0)
    assert len(remembered.rows) == 2  # the first two rows only
    assert torch.equal(remembered(x[:2]).full(), live[:2]) and (remembered.computed, remembered.reused) == (3, 2)
    assert torch.equal(remembered(x[1:]).full(), live[1:]) and (remembered.computed, remembered.reused) == (5, 2)  # row 2 was not kept


def test_chunked_scoring_gives_the_numbers_of_whole_rows(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    model = streaming.materialize(load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    x = ids(4, 40)
    whole = compare(torch_forward(model, CPU), {"o": torch_forward(other, CPU)}, x, 4, batch_size=2)["o"]
    vocab = model.config.vocab_size
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 5 * vocab)  # 5 positions at a time
    chunked = compare(torch_forward(model, CPU), {"o": torch_forward(other, CPU)}, x, 4, batch_size=2)["o"]
    for key in ("perplexity", "top1_agreement", "tokens_scored"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5), key
    # KL here is ~2e-4 nats, a small difference of two float32 log-probabilities per position, so the
    # head's matmul rounding over 5 positions instead of 40 moves it relatively more (1.3e-5 on the CI
    # machine); a lost or repeated position of the 160 scored would move it by far more.
    assert chunked["kl_divergence"] == pytest.approx(whole["kl_divergence"], rel=1e-4)
    assert chunked.intervals["kl_divergence"]["lower"] == pytest.approx(whole.intervals["kl_divergence"]["lower"], rel=1e-3)
    # logits as a plain tensor (a runtime's forward) score as hidden states and a head do (the head's
    # matmul over a whole row rounds a little differently from one over 5 positions)
    as_logits = compare(lambda b: torch_forward(model, CPU)(b).full(), {"o": torch_forward(other, CPU)}, x, 4, batch_size=2)["o"]
    assert as_logits["kl_divergence"] == pytest.approx(whole["kl_divergence"], rel=1e-3)


def test_the_head_sees_each_chunk_as_a_plain_matrix() -> None:
    """A row's chunk goes to the head as a 2-D [positions, hidden] tensor, not a 3-D view of a row of
    the batch: on that view torch's CPU linear copied the whole head weight on every call."""
    hidden = torch.randn(3, 20, 8)
    weight = torch.randn(11, 8)
    seen = []

    def head(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dim())
        return x @ weight.t()

    states = metrics.HiddenStates(hidden, head)
    assert torch.equal(states.logits(1, slice(4, 9)), hidden[1, 4:9] @ weight.t())
    assert seen == [2]


def test_the_head_read_from_disk_by_slices_gives_the_held_heads_logits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The exports' verifiers read the streamed head a slice of rows at a time (its last slice
    partial) and never hold it whole; the logits are the held head's."""
    model = load_model(ModelConfig(source=str(tiny_model_dir)), Path("."), QUIET).model
    head = model.get_output_embeddings()
    rows, cols = head.weight.shape
    monkeypatch.setattr(metrics, "HEAD_SLICE_BYTES", 7 * cols * head.weight.element_size())  # 7 rows a read
    reads: list[int] = []
    store = streaming.store_of(model)
    real = store.read_rows
    monkeypatch.setattr(store, "read_rows", lambda name, a, b: reads.append(b - a) or real(name, a, b))
    x = ids(3)
    cached = CachedBaseline(model, CPU, tmp_path / "baseline", "sha")
    held = cached(x).full()
    reads.clear()
    from_disk = head_read_from_disk(cached)(x)
    assert torch.allclose(from_disk.full(), held, rtol=1e-5, atol=1e-6)  # float32 GEMMs block a narrower slice differently
    assert max(reads) == 7 and sum(reads) == rows and reads[-1] == (rows % 7 or 7)  # every row once, 7 at a time
    assert resident_tensors(model) == []  # the head was never loaded whole
    scores = compare(head_read_from_disk(cached), {"same": torch_forward(model, CPU)}, x, 4)
    assert scores["same"]["kl_divergence"] == pytest.approx(0.0, abs=1e-6) and scores["same"]["top1_agreement"] == 1.0
    # an in-memory model has no stored head to read: its forward is left as it is
    in_memory = RememberedRows(streaming.materialize(copy.deepcopy(model)), CPU, limit=1)
    assert metrics.head_from_disk(in_memory.model) is None and head_read_from_disk(in_memory) is in_memory


def test_rows_of_a_stored_tensor_are_read_alone(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    t = torch.arange(60, dtype=torch.float32).reshape(12, 5)
    save_file({"a": torch.ones(3), "t": t}, str(tmp_path / "x.safetensors"))
    assert torch.equal(streaming.read_rows(tmp_path / "x.safetensors", "t", 4, 9), t[4:9])
    assert streaming.read_rows(tmp_path / "x.safetensors", "t", 5, 5).shape == (0, 5)
    with pytest.raises(ValueError, match="no rows 10:13"):
        streaming.read_rows(tmp_path / "x.safetensors", "t", 10, 13)


def test_records_wait_on_disk_and_come_back_exactly(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "records")
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    record = rtn_quantize(torch.randn(8, 70), scheme)
    store["a.b"] = record
    back = store["a.b"]
    assert torch.equal(back.codes, record.codes) and torch.equal(back.scale, record.scale) and back.scheme == scheme
    assert list(store) == ["a.b"] and len(store) == 1 and len(list((tmp_path / "records").rglob("*.safetensors"))) == 1
    del store["a.b"]
    assert "a.b" not in store


def test_a_source_file_changed_while_the_run_reads_it_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    source = tmp_path / "model"
    shutil.copytree(tiny_model_dir, source)
    model = load_model(ModelConfig(source=str(source)), Path("."), QUIET).model
    with torch.no_grad():
        model(input_ids=ids(), use_cache=False)  # reads fine
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(streaming.ChangedFileError, match="changed while the run was reading it"):
        with torch.no_grad():
            model(input_ids=ids(), use_cache=False)
