"""The baseline's side of every comparison in a run, computed once.

Every comparison a run makes — the in-memory compressed model, and each export's verifier on its
own runtime — scores against the source model on the same evaluation rows. Instead of running the
source again for each (a whole streamed pass over the checkpoint), the source's final hidden states
(the output of its last norm: the head's input) are computed the first time a row is asked for and
kept on disk, one file per row, named by the SHA-256 of the row's token ids, in a folder keyed by the
source's SHA-256, its dtype and the device. The logits are then the source's own head applied to
them, a chunk of positions at a time (``HiddenStates``): the same numbers as a live pass, at the
cost of the head alone, and hidden-size rather than vocabulary-size files (1,536 vs 151,936 values
a position for Qwen2.5-1.5B).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from compress import streaming
from compress.eval.metrics import Forward, HiddenStates, final_hidden, head_from_disk, with_head


class CachedBaseline:
    """A ``Forward`` over the baseline whose final hidden states are computed once per row and read
    back from ``directory`` after that. ``computed`` and ``reused`` count rows."""

    def __init__(self, model: torch.nn.Module, device: torch.device, directory: Path, source_sha256: str | None) -> None:
        self.model, self.device = model, torch.device(device)
        key = hashlib.sha256(f"{source_sha256}|{model.dtype}|{self.device.type}".encode()).hexdigest()[:24]
        self.directory = Path(directory) / key
        self.computed = 0
        self.reused = 0

    def _file(self, row: torch.Tensor) -> Path:
        return self.directory / f"{_row_key(row)[:32]}.safetensors"

    def __call__(self, ids: torch.Tensor) -> HiddenStates:
        from safetensors.torch import load_file, save_file

        files = [self._file(row) for row in ids]
        missing = [i for i, f in enumerate(files) if not f.is_file()]
        if missing:
            streaming.to_device(self.model, self.device)
            with torch.inference_mode():
                hidden = final_hidden(self.model, ids[missing], self.device)
            self.directory.mkdir(parents=True, exist_ok=True)
            for i, h in zip(missing, hidden, strict=True):
                tmp = files[i].with_suffix(".tmp")
                save_file({"hidden": h.detach().contiguous().cpu()}, str(tmp))
                tmp.replace(files[i])
            self.computed += len(missing)
        self.reused += len(files) - len(missing)
        rows = torch.stack([load_file(str(f))["hidden"] for f in files]).to(self.device)
        return with_head(self.model, rows, self.device)


def _row_key(row: torch.Tensor) -> str:
    return hashlib.sha256(row.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


class RememberedRows:
    """A ``Forward`` over the compressed model that keeps in memory the final hidden states of the
    first ``limit`` rows it computes (hidden-size values a position: 1.5 MB for a 512-token row of
    Qwen2.5-1.5B in bfloat16). The evaluation computes them; an export's same-weights check asks
    for the same rows again and gets them without another pass over the model, which would stream
    every block (and the token embedding) while the export's runtime holds its own copy."""

    def __init__(self, model: torch.nn.Module, device: torch.device, limit: int) -> None:
        self.model, self.device, self.limit = model, torch.device(device), limit
        self.rows: dict[str, torch.Tensor] = {}
        self.computed = 0
        self.reused = 0

    def __call__(self, ids: torch.Tensor) -> HiddenStates:
        keys = [_row_key(row) for row in ids]
        if all(k in self.rows for k in keys):
            hidden = torch.stack([self.rows[k] for k in keys]).to(self.device)
            self.reused += len(keys)
        else:
            streaming.to_device(self.model, self.device)
            with torch.inference_mode():
                hidden = final_hidden(self.model, ids, self.device)
            for key, h in zip(keys, hidden, strict=True):
                if len(self.rows) < self.limit and key not in self.rows:
                    self.rows[key] = h.detach().cpu().clone()
            self.computed += len(keys)
        return with_head(self.model, hidden, self.device)


def head_read_from_disk(forward: CachedBaseline | RememberedRows) -> Forward:
    """``forward`` with its model's head read from disk a slice at a time instead of held (``head_from_disk``):
    for the exports' verifiers, which score while their runtime holds its own copy of the model (the
    head of Qwen2.5-1.5B is 445 MiB beside llama.cpp's 945 MB). The forward itself when the head is
    not streamed."""
    head = head_from_disk(forward.model)
    if head is None:
        return forward

    def call(ids: torch.Tensor) -> HiddenStates:
        return HiddenStates(forward(ids).hidden, head)

    return call
