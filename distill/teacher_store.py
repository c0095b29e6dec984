"""A distillation teacher's top-k log-probs on the training chunks, computed once and kept on disk.

A teacher that does not fit in memory beside the student (``distill: {stored_teacher: {top_k}}``)
runs once over every training chunk before the first step, one block at a time when it is the
streamed source (compress/streaming.py), and each position's k most likely tokens (log-probs at
the loss's temperature, token ids) and the log of the probability of all the others are written
to disk, one file per chunk named by the SHA-256 of its token ids, in a folder keyed by the
teacher (the source's SHA-256, or the run and stage for another teacher), its dtype, the device,
autocast, k and the temperature (``StoredTeacher``). Training then reads a batch's rows back
instead of running the teacher (distill/losses.py ``topk_kl_loss``). The folder is
OUTPUT.work/<stage>/teacher/, beside the stage's training checkpoints and with the same lifetime:
kept when a run fails or is killed (the run started again reuses every row it finds), removed
when the artifact is complete.

Size per chunk: seq_len x (8 k + 4) bytes (float32 values, int32 ids, float32 rest): 0.26 MB for
512 tokens at k = 64, against 100 MB for SmolLM2's full 49,152-token float32 log-probs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from compress import streaming
from compress.distill.losses import topk_log_probs

FOLDER = "teacher"
"""The stored teachers' folder in the stage's work folder (OUTPUT.work/stages[i]/)."""


class TeacherLogits:
    """The teacher's top-k log-probs by training chunk. ``computed`` and ``reused`` count chunks."""

    def __init__(
        self, teacher: torch.nn.Module, teacher_id: str, directory: Path, device: torch.device, top_k: int, temperature: float, bf16: bool
    ) -> None:
        self.teacher, self.device = teacher, torch.device(device)
        self.top_k = min(top_k, int(teacher.config.vocab_size))
        self.temperature, self.bf16 = temperature, bf16
        settings = f"{teacher_id}|{teacher.dtype}|{self.device.type}|bf16={bf16}|k={self.top_k}|T={temperature!r}"
        self.key = hashlib.sha256(settings.encode()).hexdigest()[:24]
        self.directory = Path(directory) / self.key
        self.computed = 0
        self.reused = 0

    def _file(self, row: torch.Tensor) -> Path:
        return self.directory / f"{hashlib.sha256(row.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:32]}.safetensors"

    def fill(self, tokens: torch.Tensor, batch_size: int, progress: Callable[..., Iterable] | None = None) -> None:
        """Compute and write the rows of ``tokens`` [n, seq_len] that are not on disk yet."""
        from safetensors.torch import save_file

        files = [self._file(row) for row in tokens]
        missing = list(dict.fromkeys(i for i, f in enumerate(files) if not f.is_file()))
        self.reused += len(files) - len(missing)
        if not missing:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        streaming.to_device(self.teacher, self.device)
        batches = [missing[i : i + batch_size] for i in range(0, len(missing), batch_size)]
        for rows in progress(batches, "distill: teacher top-k log-probs", len(batches)) if progress else batches:
            with torch.inference_mode(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.teacher(input_ids=tokens[rows].to(self.device), use_cache=False).logits
            values, indices, rest = topk_log_probs(logits, self.top_k, self.temperature)
            for j, i in enumerate(rows):
                tmp = files[i].with_suffix(".tmp")
                save_file({"values": values[j].cpu(), "indices": indices[j].cpu(), "rest": rest[j].cpu()}, str(tmp))
                tmp.replace(files[i])
            self.computed += len(rows)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, indices, rest) of the rows ``ids`` [b, seq_len], stacked, on the device."""
        from safetensors.torch import load_file

        found = [load_file(str(self._file(row))) for row in ids]
        return tuple(torch.stack([f[name] for f in found]).to(self.device) for name in ("values", "indices", "rest"))  # type: ignore[return-value]

    def facts(self) -> dict[str, object]:
        """For the stage's summary."""
        return {
            "top_k": self.top_k,
            "folder": f"{FOLDER}/{self.key}",
            "chunks_computed": self.computed,
            "chunks_reused": self.reused,
            "loss": "KL over the teacher's top_k tokens and one bucket for the rest of the vocabulary",
        }
