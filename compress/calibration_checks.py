"""Calibration sanity checks: bad calibration text, or text that drives the model somewhere odd,
stops the run with a message instead of going through silently.

Checked on the calibration chunks when they are first made (``check_text``):

- ``duplicates``: chunks that nearly repeat an earlier chunk (the same document twice in a folder,
  a boilerplate-heavy corpus). Each chunk's token 8-grams are summarized by a MinHash signature;
  two chunks whose signatures estimate a Jaccard similarity of at least 0.5 count as near duplicates.
- ``padding``: the special tokens (padding, BOS, EOS, ...) or one single token making up more than
  ``max_padding_share`` of the tokens.

Checked by the calibrated quantizers while they run (quantizers/sequential.py, quantizers/gptq.py):

- ``tokens``: GPTQ's Hessian of a layer with ``n`` input columns is a sum of one outer product per
  calibration token, so fewer tokens than columns leave it rank-deficient.
- ``nonfinite``: NaN or infinite values in the hidden states entering or leaving any block.
- ``layer_error``: a layer whose relative quantization error is far above the median of the layers of
  its kind in the stage (the same name within its block, the same bits per weight).

Each check's severity comes from the recipe (``data.calibration.checks``): an ``error`` stops the
run (exit 2), a ``warn`` prints a warning and goes on, ``off`` skips it. Every result, passed or not,
goes into manifest.json under ``data.calibration.checks``.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from compress.errors import DataError

if TYPE_CHECKING:
    from compress.progress import Reporter
    from compress.schema.recipe import CalibrationChecks

NGRAM = 8
"""Tokens per shingle of the near-duplicate check (a chunk shorter than 2 x NGRAM uses half its length)."""
MINHASH = 64
"""Hash functions of a chunk's MinHash signature (the Jaccard estimate's standard error is at most 1/16)."""
NEAR_DUPLICATE = 0.5
"""Estimated Jaccard similarity of two chunks' 8-gram sets from which they count as near duplicates."""
SIGNATURE_ROWS = 256
"""Chunks hashed at a time by ``minhash_signatures`` (256 x 2,048 tokens x 8 is 32 MB of shingle terms)."""
MIN_LAYERS_OF_A_KIND = 3
"""Layers of one kind in a stage needed before a median says what is normal for them."""
ERROR_FLOOR = 1e-3
"""Relative error (30 dB SQNR) below which no layer counts as an outlier, however far above its kind's
median: re-quantizing weights onto the grid they came from gives errors near zero, whose ratios mean nothing."""
ERROR_ROWS = 8192
"""Weight rows compared at a time by ``relative_error`` (a 151,936-row output head in float32 is 0.9 GB)."""


@dataclass
class CheckResult:
    """One check's outcome, as manifest.json records it."""

    check: str
    status: Literal["passed", "warned", "failed"]
    where: str
    value: float | None
    limit: float | None
    detail: str


class CalibrationChecker:
    """Applies the recipe's severities and keeps every result for the manifest."""

    def __init__(self, config: CalibrationChecks, reporter: Reporter) -> None:
        self.config = config
        self.reporter = reporter
        self.results: list[CheckResult] = []

    def enabled(self, check: str) -> bool:
        return getattr(self.config, check) != "off"

    def record(self, check: str, ok: bool, where: str, value: float | None, limit: float | None, detail: str) -> None:
        """Keep one result; a failed check raises (``error``) or warns (``warn``)."""
        severity = getattr(self.config, check)
        if severity == "off":
            return
        status: Literal["passed", "warned", "failed"] = "passed" if ok else ("failed" if severity == "error" else "warned")
        self.results.append(CheckResult(check, status, where, value, limit, detail))
        if ok:
            return
        message = f"{where}: {detail}"
        if severity == "error":
            raise DataError(f"{message}. Set data.calibration.checks.{check}: warn to go on anyway (or off to skip the check).")
        self.reporter.warn(f"{message} (data.calibration.checks.{check}: warn)")

    def facts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.results]


# --------------------------------------------------------------------------- the text


def minhash_signatures(tokens: torch.Tensor, ngram: int = NGRAM, hashes: int = MINHASH, seed: int = 0) -> np.ndarray:
    """[chunks, hashes] MinHash signatures of each chunk's set of token ``ngram``-grams."""
    ids = tokens.to(torch.int64).numpy().astype(np.uint64)
    n = max(1, min(ngram, ids.shape[1] // 2))
    powers = np.array([pow(1_000_003, k, 2**64) for k in range(n)], dtype=np.uint64)
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=hashes, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd multipliers
    b = rng.integers(0, 2**63, size=hashes, dtype=np.uint64)
    out = np.empty((ids.shape[0], hashes), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, ids.shape[0], SIGNATURE_ROWS):  # [rows, shingles, n] at a time: bounded memory
            windows = np.lib.stride_tricks.sliding_window_view(ids[start : start + SIGNATURE_ROWS], n, axis=1)
            shingles = (windows * powers).sum(axis=2, dtype=np.uint64)  # a polynomial hash, wrapping mod 2**64
            for k in range(hashes):
                out[start : start + SIGNATURE_ROWS, k] = ((shingles * a[k] + b[k]) >> np.uint64(20)).min(axis=1)
    return out


def near_duplicates(tokens: torch.Tensor, threshold: float = NEAR_DUPLICATE) -> list[tuple[int, int, float]]:
    """(chunk, earlier chunk, estimated Jaccard) for every chunk that nearly repeats an earlier one."""
    sig = minhash_signatures(tokens)
    found = []
    for i in range(1, sig.shape[0]):
        similar = (sig[:i] == sig[i]).mean(axis=1)
        j = int(similar.argmax())
        if similar[j] >= threshold:
            found.append((i, j, float(similar[j])))
    return found


def dominant_tokens(tokens: torch.Tensor, special_ids: list[int]) -> tuple[float, str]:
    """The larger of the special tokens' share and the most frequent single token's share, and which."""
    flat = tokens.reshape(-1)
    special_count = int(torch.isin(flat, torch.tensor(sorted(set(special_ids)), dtype=flat.dtype)).sum()) if special_ids else 0
    values, counts = torch.unique(flat, return_counts=True)
    top = int(counts.argmax())
    if special_count >= int(counts[top]):
        return special_count / flat.numel(), "special tokens (padding, BOS, EOS, ...)"
    return int(counts[top]) / flat.numel(), f"token id {int(values[top])}"


def check_text(checker: CalibrationChecker, tokens: torch.Tensor, tokenizer: Any) -> None:
    """The duplicates and padding checks on the calibration chunks [samples, seq_len]."""
    where = "data.calibration"
    cfg = checker.config
    if checker.enabled("duplicates"):
        dupes = near_duplicates(tokens)
        share = len(dupes) / tokens.shape[0]
        detail = (
            f"{len(dupes)} of {tokens.shape[0]} chunks nearly repeat an earlier chunk ({share:.1%}, limit {cfg.max_duplicate_share:.1%})"
        )
        if dupes:
            i, j, sim = dupes[0]
            detail += (
                f"; first: chunk {i} ~ chunk {j} (estimated Jaccard {sim:.2f} of their token 8-grams): the text holds repeated documents"
            )
        checker.record("duplicates", share <= cfg.max_duplicate_share, where, round(share, 4), cfg.max_duplicate_share, detail)
    if checker.enabled("padding"):
        share, what = dominant_tokens(tokens, list(getattr(tokenizer, "all_special_ids", []) or []))
        detail = f"{what} make up {share:.1%} of the calibration tokens (limit {cfg.max_padding_share:.0%})"
        checker.record("padding", share <= cfg.max_padding_share, where, round(share, 4), cfg.max_padding_share, detail)


# --------------------------------------------------------------------------- the model


def check_token_count(checker: CalibrationChecker | None, tokens: int, columns: dict[str, int], where: str, method: str) -> None:
    """``tokens`` calibration tokens against the widest of ``columns`` (layer -> input columns)."""
    if checker is None or not checker.enabled("tokens") or not columns:
        return
    widest = max(columns, key=lambda k: columns[k])
    need = columns[widest]
    detail = (
        f"{method} sees {tokens:,} calibration tokens and {widest} has {need:,} input columns: its Hessian has rank at most "
        f"{min(tokens, need):,} of {need:,}"
    )
    if tokens < need:
        detail += "; raise data.calibration.samples or seq_len"
    checker.record("tokens", tokens >= need, where, tokens, need, detail)


def check_finite(checker: CalibrationChecker | None, hidden: list[torch.Tensor], where: str, what: str) -> bool:
    """False (after recording the failure) when ``hidden`` holds a NaN or an infinity."""
    if checker is None or not checker.enabled("nonfinite"):
        return True
    bad = sum(int((~torch.isfinite(h)).sum()) for h in hidden)
    if not bad:
        return True
    total = sum(h.numel() for h in hidden)
    checker.record("nonfinite", False, where, bad, 0, f"{what} holds {bad:,} NaN or infinite values of {total:,} on the calibration text")
    return False


def relative_error(original: torch.Tensor, approx: torch.Tensor, input_sums: torch.Tensor | None = None) -> float:
    """‖ΔW‖² / ‖W‖², each column weighted by the calibration's Σx² of its input when given: the
    diagonal part of the relative output error ‖ΔW X‖² / ‖W X‖² on the calibration tokens."""
    weights = None if input_sums is None or not float(input_sums.sum()) > 0 else input_sums.to(torch.float64)
    noise = signal = 0.0
    for start in range(0, original.shape[0], ERROR_ROWS):
        w = original[start : start + ERROR_ROWS].to(torch.float64)
        d = (w - approx[start : start + ERROR_ROWS].to(device=w.device, dtype=torch.float64)).pow(2)
        w = w.pow(2)
        if weights is not None:
            d, w = d @ weights.to(d.device), w @ weights.to(w.device)
        noise += float(d.sum())
        signal += float(w.sum())
    return noise / signal if signal > 0 else 0.0


def layer_kind(name: str) -> str:
    """A layer's name with its block (and expert) index left out: ``model.layers.*.mlp.down_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def layer_outliers(layers: dict[str, dict[str, Any]], ratio: float) -> tuple[list[tuple[str, float, float]], int]:
    """(layer, relative error, its kind's median) for each layer above ``ratio`` x its kind's median (and
    above ERROR_FLOOR), and the number of layers compared. Kinds with fewer than MIN_LAYERS_OF_A_KIND
    layers are not compared."""
    groups: dict[tuple[str, float], list[tuple[str, float]]] = {}
    for name, info in layers.items():
        if "relative_error" in info:
            groups.setdefault((layer_kind(name), info.get("bits_per_weight", 0.0)), []).append((name, info["relative_error"]))
    found, compared = [], 0
    for members in groups.values():
        if len(members) < MIN_LAYERS_OF_A_KIND:
            continue
        compared += len(members)
        median = statistics.median(e for _, e in members)
        found += [(name, err, median) for name, err in members if err > ratio * median and err > ERROR_FLOOR]
    return sorted(found, key=lambda f: -f[1] / max(f[2], 1e-30)), compared


def check_layer_errors(checker: CalibrationChecker | None, layers: dict[str, dict[str, Any]], where: str) -> None:
    if checker is None or not checker.enabled("layer_error"):
        return
    ratio = checker.config.layer_error_ratio
    found, compared = layer_outliers(layers, ratio)
    if not compared:
        return
    if not found:
        checker.record("layer_error", True, where, None, ratio, f"{compared} layers within {ratio:g}x their kind's median relative error")
        return
    listed = "; ".join(f"{name} {err:.3g} ({err / median:.0f}x the median {median:.3g})" for name, err, median in found[:5])
    detail = (
        f"{len(found)} layer(s) quantize with a relative error above {ratio:g}x the median of their kind: {listed}"
        f"{' ...' if len(found) > 5 else ''}. Keep such a layer in float (`ignore`), give it more bits, or check the "
        "calibration text"
    )
    worst = found[0]
    checker.record("layer_error", False, where, round(worst[1] / worst[2], 2), ratio, detail)
