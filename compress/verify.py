"""An output directory checked against its manifest: `compress verify`, and the first step of
`compress gate`, `publish` and `pull`.

Every directory compress writes (a run's artifact, a pulled version, a gate report) holds a
``manifest.json`` whose ``files`` maps each relative path to its SHA-256, and a ``.compress-output``
marker holding the manifest's own SHA-256 (compress/marker.py). A directory verifies when its
marker holds its manifest's digest, every path the manifest names (``files``, each export's
``path`` and ``files``) is a relative path inside the directory, every listed file is present, a
plain file (not a link, FIFO or device) and unchanged, and nothing else is there but the manifest,
the marker (and a pulled version's ``MODEL_CARD.md``, which publishing writes anew). Torch-free:
verification reads bytes, never loads a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from compress.errors import ArtifactError
from compress.fsutil import MAX_DOCUMENT, REPORT, combined_digest, read_json_object, sha256_file
from compress.marker import MANIFEST, MARKER, MODEL_CARD, entries, read_marker

RERUN = "run the recipe again (or pull the version again) to get a complete, unaltered copy"


@dataclass
class Contents:
    """A directory checked against its manifest."""

    root: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    files: dict[str, str]  # relative path -> SHA-256, manifest.json included, model card and marker not
    sizes: dict[str, int]
    content_sha256: str

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


def _json(path: Path) -> dict[str, Any]:
    data = read_json_object(path)
    if data is None and path.is_file() and (size := path.stat().st_size) > MAX_DOCUMENT:
        raise ArtifactError(f"{path} is {size:,} bytes, more than compress ever writes there (at most {MAX_DOCUMENT:,}); not read")
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
    try:
        kind, _ = read_marker(root)
    except ValueError as exc:
        raise ArtifactError(f"{root} is not verified: {exc}" + (f"; {advice}" if advice else "")) from None
    if not kind.manifest:
        raise ArtifactError(f"{root} is {kind.described}, not an artifact, pulled version or gate report; nothing to verify")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed or not all(isinstance(v, str) for v in listed.values()):
        raise ArtifactError(f"{root / MANIFEST} lists no files with their checksums; {advice}")
    outside = [f"{where} {rel!r}" for where, rel in named_paths(manifest, root / MANIFEST) if not inside(rel)]
    if outside:
        raise ArtifactError(
            f"{root / MANIFEST} names paths outside the artifact ({'; '.join(outside[:3])}): every path it names must be "
            "relative, without '..', inside the directory" + (f"; {advice}" if advice else "")
        )
    listed = {k: v for k, v in listed.items() if k != MANIFEST}  # earlier releases listed an interim manifest.json of latency runs
    present: set[str] = set()
    links: list[str] = []
    special: list[str] = []
    for rel in entries(root):
        path = root / rel
        if path.is_symlink():
            links.append(rel)
        elif path.is_file():
            present.add(rel)
        else:
            special.append(rel)
    present -= {MANIFEST, MODEL_CARD, MARKER}
    missing, extra = sorted(set(listed) - present - set(links) - set(special)), sorted(present - set(listed))
    changed = [rel for rel in sorted(set(listed) & present) if sha256_file(root / rel) != listed[rel]]
    problems = [
        f"{label}: {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
        for label, items in (
            ("missing", missing),
            ("changed since the run", changed),
            ("not in the manifest", extra),
            ("links, not files", links),
            ("special files (FIFOs, devices, sockets), not files", special),
        )
        if items
    ]
    if problems:
        raise ArtifactError(f"{root} does not match its manifest ({'; '.join(problems)})" + (f"; {advice}" if advice else ""))
    files = dict(sorted({**listed, MANIFEST: sha256_file(root / MANIFEST)}.items()))
    sizes = {rel: (root / rel).stat().st_size for rel in files}
    return Contents(root, manifest, _json(root / REPORT), files, sizes, combined_digest(files))


def named_paths(manifest: dict[str, Any], source: Path) -> Iterator[tuple[str, Any]]:
    """Every path a manifest (read from ``source``) names inside its artifact, with where it names it:
    ``files``' keys, each export's ``path`` and its ``files``' keys (relative to its path).
    ArtifactError when ``exports`` is not a list of objects."""
    yield from (("files", rel) for rel in manifest.get("files") or {})
    exports = manifest.get("exports") or []
    if not isinstance(exports, list) or not all(isinstance(e, dict) for e in exports):
        raise ArtifactError(f"{source}: `exports` is not a list of export entries (objects); run the recipe again")
    for i, export in enumerate(exports):
        folder = export.get("path")
        if folder is not None:
            yield f"exports[{i}].path", folder
        files = export.get("files") or {}
        if not isinstance(files, dict):
            raise ArtifactError(f"{source}: exports[{i}].files is not an object of paths and checksums; run the recipe again")
        yield from ((f"exports[{i}].files", rel if folder is None or not isinstance(rel, str) else f"{folder}/{rel}") for rel in files)


def inside(rel: Any) -> bool:
    """A relative POSIX path that stays inside its directory: no absolute path, no '..', no empty
    or '.' part, no backslash or NUL (a name means the same file on every system)."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = rel.split("/")
    return not PurePosixPath(rel).is_absolute() and all(part not in ("", ".", "..") for part in parts)
