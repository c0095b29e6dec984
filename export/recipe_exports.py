"""The pipeline's export glue, for every format alike: check, write + verify, report and gate the
recipe's exports by asking each one's format in compress.plugins.EXPORT_FORMATS.

Exactness is the contract: a writer packs the in-memory ``QuantizedWeight`` records without
re-quantizing, and every export is verified, by reading it back (checkpoints: identical codes,
scales, zero points and schemes) and, for a format with a runtime of its own, by running it there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from compress.errors import FormatError
from compress.eval.metrics import Evaluation
from compress.experts import expert_view
from compress.export.parity import VerifyInputs
from compress.hf_model import checksums
from compress.plugins import EXPORT_FORMATS
from compress.progress import Reporter
from compress.quantizers.core import QuantizedWeight
from compress.quantizers.kv_cache import KVCacheScheme
from compress.schema.exports import EXPORTS_DIR


def check_exports(exports: list[Any], model: nn.Module, records: dict[str, QuantizedWeight], has_eval: bool = True) -> None:
    """Fail fast, before evaluation, when an export cannot hold the records exactly (or cannot be verified)."""
    experts = [name for name in records if expert_view(model, name) is not None]
    for i, export in enumerate(exports):
        if experts:  # no format writes fused mixture-of-experts records yet (compress/experts.py)
            raise FormatError(
                f"exports[{i}] ({export.name}): the {export.format} export cannot carry the quantized experts of a mixture-of-experts "
                f"model ({experts[0]} and {len(experts) - 1} more expert matrices): its writer packs Linear layers, and these "
                "are slices of fused expert parameters. Remove the export: the artifact itself holds the records "
                "(fallback-records.safetensors) and the in-memory evaluation and gates run without it."
            )
        try:
            EXPORT_FORMATS[export.format].check(export, model, records, has_eval)
        except FormatError as exc:
            raise FormatError(f"exports[{i}] ({export.name}): {exc}") from None


def write_exports(
    root: Path,
    exports: list[Any],
    model: nn.Module,
    tokenizer: Any,
    records: dict[str, QuantizedWeight],
    reporter: Reporter,
    inputs: VerifyInputs | None = None,
    kv: KVCacheScheme | None = None,
    importance: tuple[dict[str, Any], list[str], int] | None = None,
) -> tuple[list[dict[str, Any]], list[Evaluation]]:
    """Write each export to ``root/<name>/`` and verify it (reloading its records; runtime exports
    also run on their runtime with ``inputs``). With a KV-cache scheme, each entry says under
    ``kv_cache`` what its format carries of it. With ``importance`` (the run's input sums, where its
    calibration text came from, the calibration sequence length), a format that has a file for them
    writes it (``importance`` in its entry). Returns manifest entries and runtime evaluations."""
    entries: list[dict[str, Any]] = []
    evaluations: list[Evaluation] = []
    for i, export in enumerate(exports):
        directory = root / export.name
        fmt = EXPORT_FORMATS[export.format]
        if fmt.own_runtime and inputs is None and getattr(export, "verify", False):
            raise FormatError(f"exports[{i}] ({export.name}): verify: true needs the evaluation inputs")
        entry, found = fmt.write(directory, export, model, tokenizer, records, inputs, reporter, f"exports[{i}]", kv)
        if importance is not None and importance[0]:
            facts = fmt.write_importance(directory, model, *importance)
            if facts is not None:
                entry["importance"] = facts
        entry.update(path=f"{EXPORTS_DIR}/{export.name}", files=checksums(directory))
        entries.append(entry)
        evaluations.extend(found)
    return entries, evaluations


def report_entries(entries: list[dict[str, Any]], evaluations: list[Evaluation]) -> list[dict[str, Any]]:
    """The verification entries for report.json; ``evaluated_as`` names the evaluation that
    covers the export: its own (a runtime export verified on its runtime), else ``compressed`` for
    checkpoints (the same records), None for a runtime export not run (``verify: false``, no
    TensorRT) or when the run evaluated nothing."""
    names = {e.artifact for e in evaluations}
    covered = "compressed" if "compressed" in names else None
    keys = ("name", "format", "path", "verified", "check", "not_carried", "engine", "verification_skipped")

    def evaluated_as(entry: dict[str, Any]) -> str | None:
        if entry["name"] in names:
            return entry["name"]
        return None if EXPORT_FORMATS[entry["format"]].own_runtime else covered  # a runtime export is measured on its runtime or not at all

    return [{**{k: e[k] for k in keys if k in e}, "evaluated_as": evaluated_as(e)} for e in entries]


def gate_evaluations(evaluations: list[Evaluation], exports: list[Any]) -> list[Evaluation]:
    """Evaluations by artifact name for the gates. An export holds exactly the records of the
    in-memory compressed model (its verifier proves it, or the run fails), so a gate on an export
    reads the ``compressed`` evaluation. A format with a runtime of its own (llama.cpp, ONNX Runtime,
    TensorRT) is measured there, or not at all (``verify: false``: a gate on it then fails as unmeasured,
    since the runtime computes differently and its own quantizers hold other weights)."""
    compressed = [e for e in evaluations if e.artifact == "compressed" and e.kind in ("accuracy", "task")]
    stand_ins = [
        dataclasses.replace(e, artifact=export.name)
        for export in exports
        if not EXPORT_FORMATS[export.format].own_runtime
        for e in compressed
    ]
    return [*evaluations, *stand_ins]
