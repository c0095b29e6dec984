"""Checks of an ONNX Runtime GenAI folder given as input (a folder handed to ``compress gate``)."""

from __future__ import annotations

from pathlib import Path

from compress.errors import ModelLoadError
from compress.inputs import check_json


def check_onnx(path: Path) -> None:
    """An ONNX model file parses, and the external data files it names exist next to it."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ModelLoadError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {str(exc)[:200]})") from None
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location" and not (path.parent / entry.value).is_file():
                raise ModelLoadError(f"{path}: its external data file {entry.value} is missing")


def check_genai_folder(path: Path, genai_config: str) -> None:
    """genai_config.json is JSON and every *.onnx in the folder parses."""
    check_json(path / genai_config)
    for model_file in sorted(path.glob("*.onnx")):
        check_onnx(model_file)
