"""Text sources -> documents -> deterministic token chunks for calibration and evaluation.

Calibration and evaluation text never overlap: a document that both roles use (same content)
is cut into ~4,000-character blocks at line breaks, and each block goes to one role by a fixed
hash of (document digest, block index) — independent of seeds, sample counts and sequence
lengths, so the evaluation text of a recipe does not change when its calibration settings do.

Chunks: the role's blocks are shuffled with the role's seed, tokenized in that order into one
stream (blocks joined by a blank line), and cut into non-overlapping ``seq_len`` windows until
``samples`` windows exist. When the tokenizer adds a BOS token, every window starts with it.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress import assets
from compress.errors import DataError
from compress.progress import Reporter
from compress.schema.recipe import CalibrationConfig, DataConfig, TextConfig

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl",)
BLOCK_CHARS = 4000
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Document:
    id: str  # file path (relative to its source root) or "file.jsonl:LINE"
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass
class TextSource:
    """Documents of one recipe `source`, plus facts for the manifest."""

    source: str
    documents: list[Document]
    files_sha256: str  # combined digest of the documents' contents

    @property
    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "documents": len(self.documents), "documents_sha256": self.files_sha256}


@dataclass
class Chunks:
    """Token windows of one role and how they were made."""

    role: str
    tokens: torch.Tensor  # [samples, seq_len] int64
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.tokens.to(torch.int64).numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------- documents


def resolve_files(source: str, base_dir: Path, reporter: Reporter | None = None) -> tuple[list[Path], Path]:
    """Files of a source and the root their ids are relative to."""
    asset = assets.ensure_reference(source, "text", reporter)
    if asset is not None:
        return sorted(asset.files), asset.path
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if path.is_file():
        return [path], path.parent
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _readable_suffix(p))
        if not files:
            raise DataError(f"directory {path} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
        return files, path
    if any(ch in source for ch in "*?["):
        pattern = source if Path(source).is_absolute() else str(base_dir / source)
        files = sorted(Path(p) for p in globlib.glob(pattern, recursive=True) if Path(p).is_file() and _readable_suffix(Path(p)))
        if not files:
            raise DataError(f"glob '{source}' (from {base_dir}) matches no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
        return files, base_dir
    raise DataError(f"text source '{source}' not found (looked for {path}); give a file, directory, glob or reference:<name>")


def _readable_suffix(p: Path) -> bool:
    return p.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES) or p.name.endswith(".rst.txt")


def load_source(source: str, base_dir: Path, text_field: str = "text", reporter: Reporter | None = None) -> TextSource:
    files, root = resolve_files(source, base_dir, reporter)
    docs: list[Document] = []
    for f in files:
        rel = str(f.relative_to(root)) if f.is_relative_to(root) else str(f)
        try:
            raw = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        if f.suffix in JSONL_SUFFIXES:
            docs.extend(_jsonl_documents(f, rel, raw, text_field))
        elif raw.strip():
            docs.append(Document(rel, raw))
    if not docs:
        raise DataError(f"text source '{source}' holds no text")
    digest = hashlib.sha256("".join(d.sha256 for d in docs).encode()).hexdigest()
    return TextSource(source, docs, digest)


def _jsonl_documents(path: Path, rel: str, raw: str, text_field: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        except RecursionError:
            raise DataError(f"{path}:{lineno}: JSON nested too deeply") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise DataError(f"{path}:{lineno}: record has no string field '{text_field}' (set text_field in the recipe)")
        if record[text_field].strip():
            docs.append(Document(f"{rel}:{lineno}", record[text_field]))
    return docs


# --------------------------------------------------------------------------- split


def split_blocks(text: str, target: int = BLOCK_CHARS) -> list[str]:
    """Cut ``text`` into consecutive blocks of about ``target`` characters at line breaks."""
    blocks, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= target:
            blocks.append("".join(current))
            current, size = [], 0
    if current:
        blocks.append("".join(current))
    return [b for b in blocks if b.strip()]


def _held_out(doc_sha: str, index: int, holdout: float) -> bool:
    h = hashlib.sha256(f"{doc_sha}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < holdout


def role_blocks(docs: list[Document], shared: set[str], role: str, holdout: float) -> list[str]:
    """The blocks ``role`` ("calibration"/"evaluation") may use; shared documents are split."""
    out = []
    for doc in docs:
        blocks = split_blocks(doc.text)
        if doc.sha256 not in shared:
            out.extend(blocks)
            continue
        for i, block in enumerate(blocks):
            if _held_out(doc.sha256, i, holdout) == (role == "evaluation"):
                out.append(block)
    return out


# --------------------------------------------------------------------------- tokens


def bos_prefix(tokenizer: Any) -> list[int]:
    """Tokens the tokenizer puts before text by default (e.g. BOS), found by comparison."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    if len(full) > len(plain) and full[len(full) - len(plain) :] == plain:
        return list(full[: len(full) - len(plain)])
    return []


def make_chunks(tokenizer: Any, blocks: list[str], cfg: TextConfig, role: str, source_label: str) -> Chunks:
    prefix = bos_prefix(tokenizer)
    body = cfg.seq_len - len(prefix)
    order = list(range(len(blocks)))
    random.Random(cfg.seed).shuffle(order)
    need = cfg.samples * body
    stream: list[int] = []
    used = 0
    for i in order:
        if len(stream) >= need:
            break
        stream.extend(tokenizer(blocks[i] + SEPARATOR, add_special_tokens=False)["input_ids"])
        used += 1
    if len(stream) < need:
        have = len(stream) // body
        raise DataError(
            f"{role} text '{source_label}' yields {len(stream)} tokens ({have} chunks of {cfg.seq_len}); "
            f"{cfg.samples} chunks need {need}. Lower data.{role}.samples or seq_len, or add text."
        )
    rows = [prefix + stream[k * body : (k + 1) * body] for k in range(cfg.samples)]
    tokens = torch.tensor(rows, dtype=torch.int64)
    return Chunks(role, tokens, {"blocks_available": len(blocks), "blocks_used": used, "bos_prefix": prefix})


@dataclass
class DataPlan:
    """The recipe's text sources, loaded once; chunks are built on request."""

    config: DataConfig
    calibration_source: TextSource | None
    evaluation_source: TextSource | None
    shared: set[str]

    @classmethod
    def load(cls, config: DataConfig, base_dir: Path, reporter: Reporter | None = None) -> DataPlan:
        cal = config.calibration and load_source(config.calibration.source, base_dir, config.calibration.text_field, reporter)
        ev = config.evaluation and load_source(config.evaluation.source, base_dir, config.evaluation.text_field, reporter)
        shared = {d.sha256 for d in cal.documents} & {d.sha256 for d in ev.documents} if cal and ev else set()
        return cls(config, cal or None, ev or None, shared)

    def tokens(
        self,
        role: str,
        tokenizer: Any,
        samples: int,
        seq_len: int,
        source: str | list[str] | None = None,
        seed: int | None = None,
        text_field: str | None = None,
        base_dir: Path | None = None,
        reporter: Reporter | None = None,
    ) -> torch.Tensor:
        """Token chunks [samples, seq_len] of ``role`` at a size a stage chooses. A calibration
        ``source`` other than the recipe's is loaded now and still kept apart from the evaluation
        text the same way (see the module docstring); a list of sources gives each an equal share
        of the chunks (the first ones one more when they do not divide evenly)."""
        if isinstance(source, list):
            if not source:
                raise DataError("an empty list of text sources")
            shares = [samples // len(source) + (i < samples % len(source)) for i in range(len(source))]
            parts = [
                self.tokens(role, tokenizer, n, seq_len, s, seed, text_field, base_dir, reporter)
                for s, n in zip(source, shares, strict=True)
                if n
            ]
            return torch.cat(parts)
        plan = self
        calibration = self.config.calibration
        if role == "calibration" and source is not None and (calibration is None or source != calibration.source):
            other = CalibrationConfig(source=source, samples=samples, seq_len=seq_len, seed=seed or 0, text_field=text_field or "text")
            plan = DataPlan.load(self.config.model_copy(update={"calibration": other}), base_dir or Path("."), reporter)
        reporter = reporter or Reporter(quiet=True)
        with reporter.status(f"tokenizing {samples} x {seq_len} tokens of {role} text"):
            return plan.chunks(role, tokenizer, samples=samples, seq_len=seq_len, seed=seed).tokens

    def text_for(self, tokenizer: Any, base_dir: Path, reporter: Reporter | None = None) -> Callable[..., torch.Tensor]:
        """:meth:`tokens` bound to a tokenizer and base directory: the ``RunContext.text`` stages call."""

        def text(
            role: str, samples: int, seq_len: int, source: str | list[str] | None, seed: int | None, text_field: str | None
        ) -> torch.Tensor:
            return self.tokens(role, tokenizer, samples, seq_len, source, seed, text_field, base_dir, reporter)

        return text

    def chunks(self, role: str, tokenizer: Any, samples: int | None = None, seq_len: int | None = None, seed: int | None = None) -> Chunks:
        """Token chunks of ``role``'s text; ``samples``/``seq_len``/``seed`` override the recipe's
        (long-context evaluation, distillation training text)."""
        cfg: TextConfig | None = getattr(self.config, role)
        source: TextSource | None = getattr(self, f"{role}_source")
        if cfg is None or source is None:
            raise DataError(f"the recipe has no data.{role} section")
        overrides = {k: v for k, v in (("samples", samples), ("seq_len", seq_len), ("seed", seed)) if v is not None}
        cfg = cfg.model_copy(update=overrides)
        blocks = role_blocks(source.documents, self.shared, role, self.config.holdout)
        if not blocks:
            raise DataError(f"no {role} text is left after holding out shared documents (data.holdout={self.config.holdout})")
        chunks = make_chunks(tokenizer, blocks, cfg, role, cfg.source)
        chunks.facts = {
            **source.describe,
            **chunks.facts,
            "samples": cfg.samples,
            "seq_len": cfg.seq_len,
            "seed": cfg.seed,
            "tokens_sha256": chunks.sha256,
            "split": (
                f"shares {len([d for d in source.documents if d.sha256 in self.shared])} documents with the other role; "
                f"their blocks are split {self.config.holdout:.0%} evaluation / {1 - self.config.holdout:.0%} calibration"
                if self.shared
                else "no documents shared with the other role"
            ),
        }
        return chunks
