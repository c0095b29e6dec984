"""ONNX Runtime GenAI's model builder (``python -m onnxruntime_genai.models.builder``), driven as a
subprocess, plus the graph edits we make to what it writes: MatMulNBits initializers from our
records, the accuracy level, and a tokenizer.json onnxruntime-extensions reads like the Hugging Face one.

The builder is run as a program (its documented interface) rather than imported: it puts its own
folder on ``sys.path``, prints progress bars, and keeps module-level state; a subprocess keeps all
of that out of the pipeline and its log lands next to the export.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from compress.errors import FormatError
from compress.export.onnx import matmulnbits as mnb
from compress.export.onnx.names import GENAI_CONFIG, ONNX_FILE
from compress.quantizers.core import QuantizedWeight

DATA_FILE = "model.onnx.data"
BUILDER_MODULE = "onnxruntime_genai.models.builder"
# Layers we never hand to the builder's own quantizer: without a record they stay float.
HEAD_NODE = "/lm_head/MatMul"
EMBEDDING_NODE = "/model/embed_tokens/Gather"
FLOAT_NODES = (HEAD_NODE, EMBEDDING_NODE)
HEAD_LAYER = "lm_head"  # the Hugging Face name of the output head in every architecture the builder writes
EXTRA = 'the onnx extra: pip install -e ".[onnx]" (onnx, onnxruntime, onnxruntime-genai, onnxscript)'

# Builder node names → the Hugging Face Linear names they compute (fused q/k/v and gate/up included).
_NODE = re.compile(
    r"^/model/layers\.(\d+)/(attn|mlp)/(\w+)/(?:MatMulNBits|MatMul_Q\d+|MatMul)$"
)  # from a GPTQ checkpoint / from its own quantizer / float (a w8a8 export's, export/onnx/w8a8.py)
_HEAD = re.compile(r"^/lm_head/(?:MatMulNBits|MatMul_Q\d+|MatMul)$")
_PARTS = {
    ("attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("attn", "q_proj"): ("self_attn.q_proj",),
    ("attn", "k_proj"): ("self_attn.k_proj",),
    ("attn", "v_proj"): ("self_attn.v_proj",),
    ("attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "gate_proj"): ("mlp.gate_proj",),
    ("mlp", "up_proj"): ("mlp.up_proj",),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


def require(modules: tuple[str, ...] = ("onnx", "onnxruntime", "onnxruntime_genai"), what: str = "ONNX export") -> None:
    """Raise a FormatError naming the extra when a module ``what`` needs is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise FormatError(f"{what} needs {', '.join(missing)}: install {EXTRA}")


def run_builder(source: Path, out: Path, precision: str, device: str, options: dict[str, Any], log: Path) -> None:
    """Run the builder on the Hugging Face directory ``source``; its output goes to ``out``, its
    console to ``log``. Raises FormatError with the log's tail when it fails."""
    cache = out.parent / f".{out.name}.builder-cache"
    cmd = [sys.executable, "-m", BUILDER_MODULE, "-i", str(source), "-o", str(out), "-p", precision, "-e", device, "-c", str(cache)]
    if options:
        cmd += ["--extra_options", *(f"{k}={_option(v)}" for k, v in options.items())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    _remove_tree(cache)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
        raise FormatError(f"onnxruntime-genai's builder failed (exit {done.returncode}; log {log}):\n{tail}")


def _option(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- graph edits


def load(directory: Path, with_data: bool = True) -> Any:
    import onnx

    return onnx.load(str(directory / ONNX_FILE), load_external_data=with_data)


def save(model: Any, directory: Path) -> None:
    """Write model.onnx with every initializer in model.onnx.data, replacing both. onnx appends to an
    existing data file, so both are written in a fresh folder next to them and then moved in."""
    import onnx

    tmp = directory / ".rewrite"
    _remove_tree(tmp)
    tmp.mkdir()
    onnx.save_model(
        model, str(tmp / ONNX_FILE), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_FILE, size_threshold=1024
    )
    for name in (DATA_FILE, ONNX_FILE):
        (tmp / name).chmod(0o644)  # onnx creates the data file private to its owner
        os.replace(tmp / name, directory / name)
    tmp.rmdir()


def attributes(node: Any) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def set_attribute(node: Any, name: str, value: Any) -> None:
    import onnx

    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(onnx.helper.make_attribute(name, value))


def layer_names(node_name: str) -> tuple[str, ...] | None:
    """The Hugging Face Linear names a builder MatMulNBits (or float MatMul) node computes (the output head included), or
    None for a node that computes no Linear layer."""
    if _HEAD.match(node_name):
        return (HEAD_LAYER,)
    m = _NODE.match(node_name)
    if not m:
        return None
    index, block, proj = m.groups()
    parts = _PARTS.get((block, proj))
    if parts is None:
        raise FormatError(f"ONNX node {node_name}: unknown projection '{proj}' (update onnx_builder._PARTS)")
    return tuple(f"model.layers.{index}.{p}" for p in parts)


def quantized_nodes(model: Any) -> list[tuple[Any, tuple[str, ...] | None]]:
    return [(n, layer_names(n.name)) for n in model.graph.node if n.op_type == "MatMulNBits"]


def _initializers(model: Any) -> dict[str, Any]:
    return {t.name: t for t in model.graph.initializer}


def node_blocks(node: Any, inits: dict[str, Any]) -> mnb.Blocks:
    from onnx import numpy_helper

    a = attributes(node)

    def array(i: int) -> np.ndarray | None:
        if len(node.input) <= i or not node.input[i]:
            return None
        return numpy_helper.to_array(inits[node.input[i]])

    return mnb.unpack(array(1), array(2), array(3), int(a["N"]), int(a["K"]), int(a["bits"]), int(a["block_size"]))


def expected_blocks(names: tuple[str, ...], records: dict[str, QuantizedWeight], block_size: int) -> mnb.Blocks:
    missing = [n for n in names if n not in records]
    if missing:
        raise FormatError(f"{', '.join(missing)}: no quantizer record; an int ONNX export needs every decoder Linear quantized")
    return mnb.concat_rows([mnb.record_blocks(records[n], block_size) for n in names])


def compare_records(model: Any, records: dict[str, QuantizedWeight]) -> dict[str, Any]:
    """Unpack every MatMulNBits node that computes recorded layers and compare codes, scales and zero
    points with the records (as blocks). Returns the counts and the problems found."""
    inits = _initializers(model)
    problems: list[str] = []
    covered: set[str] = set()
    nodes = 0
    for node, names in quantized_nodes(model):
        if names is None:
            continue
        nodes += 1
        got = node_blocks(node, inits)
        try:
            want = expected_blocks(names, records, got.block_size)
        except FormatError as exc:
            problems.append(f"{node.name}: {exc}")
            continue
        diff = mnb.differences(want, got)
        if got.block_size not in mnb.BLOCK_SIZES:  # the file would not load (e.g. a per-channel GPTQ row taken as one block)
            diff.append(f"block size {got.block_size} is not one ONNX Runtime runs ({', '.join(map(str, mnb.BLOCK_SIZES))})")
        if diff:
            problems.append(f"{node.name}: {'; '.join(diff)}")
        covered.update(names)
    for name in sorted(set(records) - covered):
        problems.append(f"{name}: recorded but no MatMulNBits node holds it")
    return {"nodes": nodes, "layers": len(covered), "problems": problems}


def write_records(model: Any, records: dict[str, QuantizedWeight]) -> int:
    """Replace the initializers and attributes of every recorded MatMulNBits node with our packing
    of the records (scales in the dtype the builder chose for the node). Returns the nodes written."""
    from onnx import numpy_helper

    inits = _initializers(model)
    written = 0
    for node, names in quantized_nodes(model):
        if names is None:
            continue
        blocks = expected_blocks(names, records, int(attributes(node)["block_size"]))
        packed = mnb.pack(blocks, with_zero_points=False)
        scale_dtype = numpy_helper.to_array(inits[node.input[2]]).dtype
        packed["scales"] = packed["scales"].astype(scale_dtype)
        if not np.array_equal(packed["scales"].astype(np.float32), blocks.scales.reshape(-1)):
            raise FormatError(f"{node.name}: the scales of {', '.join(names)} do not fit {scale_dtype} exactly")
        base = node.name.strip("/").replace("/", ".")
        while len(node.input) < 4:
            node.input.append("")
        for slot, key in ((1, "B"), (2, "scales"), (3, "zero_points")):
            name = node.input[slot] or f"{base}.{key}"
            if name in inits:
                model.graph.initializer.remove(inits.pop(name))
            if key not in packed:  # every zero point is the default 2**(bits-1): the input is left out
                node.input[slot] = ""
                continue
            tensor = numpy_helper.from_array(packed[key], name)
            model.graph.initializer.append(tensor)
            inits[name] = tensor
            node.input[slot] = name
        while node.input and not node.input[-1]:
            node.input.pop()
        n, k = blocks.shape
        for attr, value in (("N", n), ("K", k), ("bits", blocks.bits), ("block_size", blocks.block_size)):
            set_attribute(node, attr, value)
        written += 1
    return written


def drop_default_zero_points(model: Any) -> int:
    """Remove zero-point inputs whose every value is the default 2**(bits−1) (symmetric records the
    builder read from a GPTQ checkpoint, which always stores zeros): same weights, a smaller file.
    Returns the nodes changed."""
    inits = _initializers(model)
    changed = 0
    for node, names in quantized_nodes(model):
        if names is None or len(node.input) < 4 or not node.input[3]:
            continue
        blocks = node_blocks(node, inits)
        if bool((blocks.zero_points != 1 << (blocks.bits - 1)).any()):
            continue
        name = node.input[3]
        if len(node.input) == 4:
            node.input.pop()
        else:  # g_idx / bias follow: keep their positions
            node.input[3] = ""
        if not any(name in other.input for other in model.graph.node):
            model.graph.initializer.remove(inits.pop(name))
        changed += 1
    return changed


def set_accuracy_level(model: Any, level: int) -> None:
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            set_attribute(node, "accuracy_level", level)


def op_counts(model: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


# --------------------------------------------------------------------------- tokenizer


def normalize_tokenizer(directory: Path) -> list[str]:
    """Make a byte-level BPE tokenizer.json plain GPT-2 style for onnxruntime-extensions, which
    mis-tokenizes one carrying ``byte_fallback`` and a SentencePiece-style decoder chain (as
    transformers writes for models converted from GGUF). For byte-level BPE both are no-ops in
    Hugging Face tokenizers (every byte has a token), so the tokenization is unchanged; the verifier
    checks parity. Returns what was changed."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = next((p for p in pres if p.get("type") == "ByteLevel"), None)
    if model.get("type") != "BPE" or byte_level is None:
        return []
    changed = []
    if model.get("byte_fallback"):
        model["byte_fallback"] = False
        changed.append("model.byte_fallback → false")
    decoder = data.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        data["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": byte_level.get("add_prefix_space", False),
            "trim_offsets": True,
            "use_regex": True,
        }
        changed.append(f"decoder {decoder.get('type')} → ByteLevel")
    digits = [p for p in pres if p.get("type") == "Digits" and p.get("individual_digits")]
    if digits and byte_level.get("use_regex", True) and len(pres) == 2:
        # SmolLM's Digits + ByteLevel: onnxruntime-extensions applies GPT-2's regex to the whole text and
        # splits digits after it (whitespace before a digit then differs: 57 of 148 parity texts on
        # SmolLM2); it does chain Split steps, and these two Splits are the same function.
        data["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\p{N}"}, "behavior": "Isolated", "invert": False},
                {"type": "Split", "pattern": {"Regex": GPT2_REGEX}, "behavior": "Isolated", "invert": False},
                {**byte_level, "use_regex": False},
            ],
        }
        changed.append("pre_tokenizer Digits + ByteLevel(regex) → Split(digits) + Split(GPT-2 regex) + ByteLevel")
    if changed:
        path.write_text(json.dumps(data, ensure_ascii=False))
    return changed


GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""The regex of Hugging Face's ByteLevel pre-tokenizer (``use_regex``), GPT-2's."""


def align_generation_ids(directory: Path, tokenizer: Any) -> list[str]:
    """genai_config.json's BOS id as the source tokenizer's, and its EOS ids (ONNX Runtime GenAI stops
    at any of them) holding the source's EOS and the chat template's end of turn (``<|im_end|>``,
    ``<end_of_turn>``): a chat reply then ends where the source's would. Returns what was changed."""
    from compress.export.parity import special_ids

    path = directory / GENAI_CONFIG
    if not path.is_file():
        return []
    config = json.loads(path.read_text())
    model = config["model"]
    want = special_ids(tokenizer)
    found = model.get("eos_token_id")
    eos = list(found) if isinstance(found, list) else [] if found is None else [found]
    changed = []
    for key in ("eos", "eot"):
        if key in want and want[key] not in eos:
            eos.append(want[key])
            changed.append(f"eos_token_id + {want[key]} (the source's {'end of turn' if key == 'eot' else 'EOS'})")
    if "bos" in want and model.get("bos_token_id") != want["bos"]:
        changed.append(f"bos_token_id {model.get('bos_token_id')} → {want['bos']}")
        model["bos_token_id"] = want["bos"]
    if changed:
        model["eos_token_id"] = eos
        path.write_text(json.dumps(config, indent=4))
    return changed
