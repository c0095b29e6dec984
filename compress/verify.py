"""An output directory checked against its manifest: `compress verify`, and the first step of
`compress gate`, `publish` and `pull`.

Every directory compress writes (a run's artifact, a pulled version, a gate report) holds a
``manifest.json`` whose ``files`` maps each relative path to its SHA-256. A directory verifies
when every listed file is present, a plain file (not a link) and unchanged, and nothing else is
there but the manifest itself (and a pulled version's ``MODEL_CARD.md``, which publishing writes
anew). Torch-free: verification reads bytes, never loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import ArtifactError
from compress.fsutil import MANIFEST, REPORT, combined_digest, read_json_object, sha256_file

MODEL_CARD = "MODEL_CARD.md"
RERUN = "run the recipe again (or pull the version again) to get a complete, unaltered copy"


@dataclass
class Contents:
    """A directory checked against its manifest."""

    root: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    files: dict[str, str]  # relative path -> SHA-256, manifest.json included, model card not
    sizes: dict[str, int]
    content_sha256: str

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


def _json(path: Path) -> dict[str, Any]:
    data = read_json_object(path)
    if data is None:
        raise ArtifactError(f"{path} cannot be read as a JSON object (missing, truncated or not JSON)")
    return data


def check_artifact(directory: str | Path, advice: str = RERUN) -> Contents:
    """Every file of ``directory`` against its manifest: nothing missing, altered, linked or extra.
    Raises ArtifactError naming the files; ``advice`` ends the message."""
    root = Path(directory)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory")
    if not (root / MANIFEST).is_file() and (root / REPORT).is_file():
        chosen = (read_json_object(root / REPORT) or {}).get("search") or {}
        if isinstance(chosen, dict) and chosen.get("chosen_path"):
            raise ArtifactError(
                f"{root} is a recipe search, not an artifact; publish its chosen candidate (or gate or verify it): "
                f"{root / str(chosen['chosen_path'])}"
            )
    if not (root / MANIFEST).is_file() or not (root / REPORT).is_file():
        raise ArtifactError(f"{root} is not a compress artifact (needs {MANIFEST} and {REPORT}, as `compress run` writes them)")
    manifest = _json(root / MANIFEST)
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed or not all(isinstance(v, str) for v in listed.values()):
        raise ArtifactError(f"{root / MANIFEST} lists no files with their checksums; {advice}")
    listed = {k: v for k, v in listed.items() if k != MANIFEST}  # earlier releases listed an interim manifest.json of latency runs
    present: set[str] = set()
    links: list[str] = []
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            links.append(rel)
        elif path.is_file():
            present.add(rel)
    present -= {MANIFEST, MODEL_CARD}
    missing, extra = sorted(set(listed) - present - set(links)), sorted(present - set(listed))
    changed = [rel for rel in sorted(set(listed) & present) if sha256_file(root / rel) != listed[rel]]
    problems = [
        f"{label}: {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
        for label, items in (
            ("missing", missing),
            ("changed since the run", changed),
            ("not in the manifest", extra),
            ("links, not files", sorted(links)),
        )
        if items
    ]
    if problems:
        raise ArtifactError(f"{root} does not match its manifest ({'; '.join(problems)})" + (f"; {advice}" if advice else ""))
    files = dict(sorted({**listed, MANIFEST: sha256_file(root / MANIFEST)}.items()))
    sizes = {rel: (root / rel).stat().st_size for rel in files}
    return Contents(root, manifest, _json(root / REPORT), files, sizes, combined_digest(files))
