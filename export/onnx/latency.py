"""An ONNX Runtime GenAI folder in the latency worker (eval/latency.py): the runner and what the
files alone say about bytes read per token and parameters."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from compress.export.format import Runner
from compress.export.onnx.names import GENAI_CONFIG, ONNX_FILE
from compress.fsutil import tree_size


class GenAIRunner(Runner):
    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime_genai as og

        config = og.Config(str(path))
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}})
        )
        self.og, self.model = og, og.Model(config)
        self.size_bytes = tree_size(path)
        self.weight_bytes, self.kv_bytes_per_position = onnx_bytes(path)

    def run(self, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
        og = self.og
        batch, length = prompts.shape
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=length + steps, min_length=length + steps, do_sample=False, batch_size=batch)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(prompts.astype(np.int32))
        generator.generate_next_token()  # picks the first token from the prompt's logits
        ttft = time.perf_counter() - start
        times = []
        for _ in range(steps - 1):
            start = time.perf_counter()
            generator.generate_next_token()  # one token's forward, then the pick
            times.append(time.perf_counter() - start)
        del generator, params  # before the model they were made from
        return ttft, times


_ONNX_ITEMSIZE = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 16: 2, 17: 1, 21: 1, 22: 1}  # TensorProto data types -> bytes


def onnx_bytes(directory: Path) -> tuple[int, int]:
    """Initializer bytes a decode step reads (ones consumed only by Gather ops are lookup tables:
    left out) and KV bytes per position from the ``past_key_values.*`` inputs."""
    import onnx

    graph = onnx.load(str(directory / ONNX_FILE), load_external_data=False).graph
    consumers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for init in graph.initializer:
        if consumers.get(init.name) and all(op.startswith("Gather") for op in consumers[init.name]):
            continue
        length = next((int(e.value) for e in init.external_data if e.key == "length"), None)
        if length is None:
            length = len(init.raw_data) or int(np.prod(init.dims)) * _ONNX_ITEMSIZE.get(init.data_type, 4)
        total += length
    decoder = json.loads((directory / GENAI_CONFIG).read_text())["model"]["decoder"]  # cache dims may be symbolic in the graph
    per_tensor = int(decoder["num_key_value_heads"]) * int(decoder["head_size"])
    kv = sum(
        per_tensor * _ONNX_ITEMSIZE.get(inp.type.tensor_type.elem_type, 4) for inp in graph.input if inp.name.startswith("past_key_values.")
    )
    return total, kv


def parameter_count(directory: Path) -> int:
    """ONNX initializers, each MatMulNBits counted as its K x N weights and a GatherBlockQuantized table
    of its own as its rows x columns (one that reads a MatMulNBits' blocks is that node's weights)."""
    import onnx

    graph = onnx.load(str(directory / ONNX_FILE), load_external_data=False).graph
    inits = {init.name: init for init in graph.initializer}
    packed_ops = ("MatMulNBits", "GatherBlockQuantized")
    packed = {name for node in graph.node if node.op_type in packed_ops for name in node.input if name in inits}
    count = sum(int(np.prod(init.dims)) for init in graph.initializer if init.name not in packed)
    for node in graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits":
            count += attrs["K"] * attrs["N"]
        elif node.op_type == "GatherBlockQuantized" and node.input[0] in inits:  # a table of its own, [rows, bytes]
            rows, width = (int(d) for d in inits[node.input[0]].dims)
            count += rows * width * 8 // attrs["bits"]
    return count
