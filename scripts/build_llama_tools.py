"""Build llama.cpp's own command-line tools (llama-quantize, llama-imatrix, llama-perplexity) from the
llama.cpp sources that the installed llama-cpp-python's sdist vendors, so that what they do is compared
with our GGUF files on the same llama.cpp as the one our verifier runs.

    python scripts/build_llama_tools.py            # -> ~/.cache/compress/llama.cpp-tools/<version>/
    python scripts/build_llama_tools.py --print    # the folder, when it is built

The sdist comes from the package index (`pip download --no-binary :all:`, cached by pip); the build is
CPU-only, static, without curl. About 10 minutes on 2 cores the first time; a finished build is kept.
The Python binding cannot hand llama.cpp's quantizer an importance matrix (its `imatrix` parameter is
a C++ map), which is why `llama-quantize --imatrix` is the tool the benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.export.gguf.tools import TOOLS, tools_dir  # noqa: E402


def build(version: str, jobs: int) -> Path:
    out = tools_dir(version)
    if all((out / t).is_file() for t in TOOLS):
        return out
    with tempfile.TemporaryDirectory(prefix="llama-tools-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps", "--no-binary", ":all:", "-d", str(work)],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = work / "build"
        flags = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TOOLS=ON",
        ]
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *flags], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *TOOLS, "-j", str(jobs)], check=True)
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, staging / tool)
        shutil.rmtree(out, ignore_errors=True)
        staging.replace(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the tools' folder if it is built (exit 1 if not)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    version = importlib.metadata.version("llama-cpp-python")
    if args.print:
        out = tools_dir(version)
        if all((out / t).is_file() for t in TOOLS):
            print(out)
            return 0
        print(f"not built: python {sys.argv[0]}", file=sys.stderr)
        return 1
    print(build(version, args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
