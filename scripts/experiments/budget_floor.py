"""Can a GGUF size budget reach the sizes of llama.cpp's own files of a model? The smallest file a
budget's types make, with the token embedding and the output head in the budget (`target.tables`,
the default) and held at `float_type` (`tables: false`, Q8_0), against llama.cpp's Q3_K_M, Q4_0 and
Q4_K_M of the same model made by its quantizer with its own rule for the embedding (issue 53: on an
untied model, tables held at Q8_0 put Q3_K_M's size out of reach).

    python scripts/experiments/budget_floor.py --model reference:smollm2-135m-float-untied
    python scripts/experiments/budget_floor.py --model M --types q3_k_m q4_0 q4_k_m q5_k_m --threads 2

No sensitivity pass: the floor is every layer's (and table's) smallest candidate type, which the
allocation starts from (quantizers/mix.py `allocate`); a budget under it is refused, one at or over
it is met. Prints a table; the F16 and llama.cpp files are made in a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torch import nn

from compress.export.gguf import runtime as gguf_runtime
from compress.export.gguf.check import tensor_totals
from compress.export.gguf.config import GGUFExportConfig
from compress.export.gguf.inputs import is_gguf_file
from compress.export.gguf.plugin import GGUF
from compress.export.gguf.writer import write_gguf
from compress.models import load_model
from compress.progress import Reporter
from compress.quantizers.arch import architecture_of
from compress.quantizers.mix import NO_TABLES, Tables, budget_tables, candidate_types
from compress.schema.recipe import ModelConfig


def floor(model: nn.Module, tokenizer: object, tables: Tables, types: list[str]) -> tuple[float, float]:
    """The smallest file of a budget over ``types``: (bits per weight as llama.cpp counts them, MiB with metadata)."""
    blocks = architecture_of(model).blocks + "."
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(blocks)}
    cfg = GGUFExportConfig(name="floor", target={"bits_per_weight": 8.0, "types": types, "tables": bool(tables.names)})
    layout = GGUF.file_layout(cfg, model, tokenizer, set(linears) | set(tables.in_file))
    shapes = {n: tuple(m.weight.shape) for n, m in linears.items()}
    shapes.update({n: tuple(model.get_submodule(n).weight.shape) for n in tables.names})
    least = layout.fixed_bytes + sum(min(layout.tensor_bytes(t, s) for t in candidate_types(s[1], types)) for s in shapes.values())
    return 8 * least / layout.params, (least + layout.metadata_bytes()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reference:smollm2-135m-float-untied", help="model source, as in a recipe")
    parser.add_argument("--types", nargs="+", default=["q3_k_m", "q4_0", "q4_k_m"], help="llama.cpp file types to compare with")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    reporter = Reporter(quiet=True)
    lm = load_model(ModelConfig(source=args.model), Path.cwd(), reporter)
    budget_types = list(GGUFExportConfig(name="t", target={"bits_per_weight": 8.0}).target.types)
    tables = budget_tables(lm.model, set())
    rows = {"tables in the budget": floor(lm.model, lm.tokenizer, tables, budget_types)}
    rows["tables at Q8_0 (tables: false)"] = floor(lm.model, lm.tokenizer, NO_TABLES, budget_types)
    print(f"{args.model}: {'tied (one table)' if tables.tied else 'untied'}; budget types {', '.join(budget_types)}\n")
    print("| file | bits/weight | MiB |\n|---|---|---|")
    for name, (bits, mib) in rows.items():
        print(f"| smallest budget file, {name} | {bits:.3f} | {mib:.2f} |")
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "f16.gguf"
        source = lm.source_path if is_gguf_file(lm.source_path) else None
        write_gguf(f16, lm.model, lm.tokenizer, {}, "f16", tokenizer_from=source)
        for type_name in args.types:
            out = Path(tmp) / f"{type_name}.gguf"
            gguf_runtime.quantize(f16, out, type_name, args.threads)  # llama.cpp's own rule for the embedding
            tensor_bytes, params = tensor_totals(out)
            bits = 8 * tensor_bytes / params
            reach = ", ".join(f"{'reached' if rows[k][0] <= bits else 'out of reach'} {k.split(' (')[0]}" for k in rows)
            print(f"| llama.cpp {type_name.upper()} | {bits:.3f} | {out.stat().st_size / 2**20:.2f} | {reach}")
            out.unlink()


if __name__ == "__main__":
    main()
