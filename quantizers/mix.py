"""Mixed precision under a size budget: one GGUF block type per quantized Linear, chosen from
measured sensitivity so that the file keeps within a GGUF export's ``target:``.

The estimator. Quantizing a Linear changes its output on token t by e_t = ΔW x_t. To second order,
the KL divergence from the model's own next-token distributions grows by ½ e_tᵀ F_t e_t, F_t the
Fisher information of the output with respect to that Linear's output. We take its diagonal,
estimated from gradients g_t of the log-likelihood of tokens *sampled from the model itself* (so
E[g gᵀ] is the Fisher, not the empirical Fisher of the text), and keep each weight's own term:

    ΔKL ≈ ½ Σ_ij ΔW_ij² · (1/T) Σ_t g_ti² x_tj²

The bracket is one matrix per Linear, [out, in], accumulated as (g²)ᵀ(x²) over the tokens (as many
multiply-adds as the forward pass). It combines what llama.cpp's importance matrix measures (the
inputs' squares, x²) with what it leaves out: how much the model's predictions depend on each output
channel of each layer (g²), so that a matrix of a late block and one of an early block are weighed on
the same scale (nats). ΔW is the round-to-nearest error of each candidate type's own grid with the
quantizers' own parameter search (quantizers/grid_search.py: range tries, least-squares refit), on every
k-th row (``SENSITIVITY_ROWS``) scaled to the whole weight; GPTQ's error feedback, which runs
afterwards, does better than rounding on every type alike.

The pass runs block by block (a streamed model holds one block at a time): the blocks' inputs are
captured forward, the head's gradient is taken one sequence at a time, then each block, last to
first, is run again with gradients to carry the gradient to its input, its Linears' brackets are
filled, and every candidate type's error is scored while the block is resident. What stays in
memory: every block's input hidden states for the ``samples`` chunks (blocks x tokens x width).

The choice. The estimates add up over layers; minimising their sum under a byte budget is a
multiple-choice knapsack, solved greedily on each layer's lower convex hull of (bytes, ΔKL): start
every layer at its smallest type, then take, while the budget allows, the upgrade that removes the
most estimated KL per byte. The tensors no stage quantizes (embeddings, norms, a float head) keep the
export's types and count against the budget as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compress import streaming
from compress.errors import CompressError
from compress.quantizers.arch import architecture_of, decoder_blocks, output_head, submodule
from compress.quantizers.grids import GRIDS, llama_cpp_spelling
from compress.quantizers.moe import expert_linears
from compress.quantizers.sequential import BlockInputs, capture_block_inputs, move_outside_blocks
from compress.schema.quantize import QuantScheme

if TYPE_CHECKING:
    from compress.context import SizeBudget

TensorBytes = Callable[[str, tuple[int, ...]], int]
"""Bytes of one tensor of a grid and shape as the export's file stores it (its ``FileLayout.tensor_bytes``)."""


def candidate_types(in_features: int, types: list[str]) -> list[str]:
    """The types a row of ``in_features`` weights may be stored as, given the allowed ``types``: each
    one, or llama.cpp's fallback where a K-quant does not divide the row; duplicates dropped."""
    found = []
    for name in types:
        grid = GRIDS[name].for_width(in_features)
        if in_features % grid.block_weights == 0 and grid.name not in found:
            found.append(grid.name)
    return found


@dataclass
class LayerChoice:
    """One Linear's options, (type, bytes, estimated ΔKL) by increasing bytes, and the one chosen."""

    name: str
    shape: tuple[int, int]
    options: list[tuple[str, int, float]]
    chosen: int = 0

    @property
    def type(self) -> str:
        return self.options[self.chosen][0]

    @property
    def bytes(self) -> int:
        return self.options[self.chosen][1]

    @property
    def estimate(self) -> float:
        return self.options[self.chosen][2]


def _hull(options: list[tuple[str, int, float]]) -> list[int]:
    """Indices of the options on the lower convex hull of (bytes, estimate), from the smallest: an
    option that buys less per byte than a larger one is never the greedy's step."""
    order = sorted(range(len(options)), key=lambda i: (options[i][1], options[i][2]))
    hull: list[int] = []
    for i in order:
        if hull and options[i][2] >= options[hull[-1]][2]:
            continue  # more bytes, no less error
        while len(hull) >= 2:
            a, b = options[hull[-2]], options[hull[-1]]
            # b lies on or above the segment from a to i: drop it
            if (b[2] - a[2]) * (options[i][1] - a[1]) >= (options[i][2] - a[2]) * (b[1] - a[1]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def allocate(layers: list[LayerChoice], budget: int) -> int:
    """Choose each layer's option so that their bytes sum to at most ``budget`` and the estimates'
    sum is small (greedy on each layer's convex hull, best estimate removed per byte first); returns
    the bytes used. Raises CompressError when even the smallest options exceed the budget."""
    hulls = {layer.name: _hull(layer.options) for layer in layers}
    for layer in layers:
        layer.chosen = hulls[layer.name][0]
    used = sum(layer.bytes for layer in layers)
    if used > budget:
        raise CompressError(f"the smallest type of every layer takes {used:,} bytes, over the {budget:,} the budget leaves them")
    by_name = {layer.name: layer for layer in layers}
    step = dict.fromkeys(hulls, 0)
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        hull, k = hulls[name], step[name]
        if k + 1 < len(hull):
            a, b = by_name[name].options[hull[k]], by_name[name].options[hull[k + 1]]
            heapq.heappush(heap, (-(a[2] - b[2]) / (b[1] - a[1]), name))

    for name in hulls:
        push(name)
    while heap:
        _, name = heapq.heappop(heap)
        layer, hull, k = by_name[name], hulls[name], step[name]
        extra = layer.options[hull[k + 1]][1] - layer.options[hull[k]][1]
        if used + extra > budget:
            continue  # this layer's next step does not fit; smaller steps of others may
        used += extra
        step[name] = k + 1
        layer.chosen = hull[k + 1]
        push(name)
    return used


# --------------------------------------------------------------------------- the sensitivity pass


SENSITIVITY_ROWS = 256
"""The sensitivity pass rounds every k-th row of each weight per candidate type, k = rows // this
(1 below it: 256 to 511 rows of a large weight), and scales their cost to the whole weight: the
quantizers' own parameter search (range tries, least-squares refit) is several times dearer than a
plain min/max rounding, and its gain differs much between types (a source grid that one type's
blocks hold), so the estimate must see it."""


def _row_stride(out_features: int) -> int:
    return max(1, out_features // SENSITIVITY_ROWS)


def _rtn_error(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The squared error of rounding ``weight`` to the type's grid with the quantizers' own search."""
    from compress.quantizers.grid_search import grid_quantize

    w = weight.detach().float()
    return (w - grid_quantize(w, QuantScheme(gguf_type=type_name)).dequantize().float()).square_()


def _head_gradients(
    model: nn.Module, arch: Any, hidden: list[torch.Tensor], device: torch.device, seed: int, head_fisher: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """d(−log p(y))/d(last block's output) per batch, y sampled from the model's own next-token
    distribution at every position (one sequence at a time: a batch of logits is batch x seq x vocab).
    With ``head_fisher`` [vocab, width], the output head's Σ_t g_t² ⊗ x_t² is added to it (g the
    gradient at the head's output, x its input), as ``_block_fisher`` does for a block's Linears."""
    from compress.eval.metrics import output_head as logits_of

    norm = submodule(model, arch.final_norm)
    head = model.get_output_embeddings()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    grads = []

    def on_output(_module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x2 = args[0].detach().float().square().reshape(-1, args[0].shape[-1])

        def on_grad(g: torch.Tensor) -> None:
            assert head_fisher is not None
            head_fisher.addmm_(g.detach().float().square().reshape(-1, g.shape[-1]).T, x2)

        output.register_hook(on_grad)

    handle = head.register_forward_hook(on_output) if head_fisher is not None else None
    try:
        with streaming.resident(norm, device), streaming.resident(head, device), torch.enable_grad():
            to_logits = logits_of(model)
            for h in hidden:
                rows = []
                for row in h:
                    x = row.unsqueeze(0).detach().requires_grad_(True)
                    logits = to_logits(norm(x)).float()
                    with torch.no_grad():
                        probs = torch.softmax(logits[0], dim=-1).cpu()
                        y = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)
                    loss = nn.functional.cross_entropy(logits[0], y, reduction="sum")
                    (g,) = torch.autograd.grad(loss, x)
                    rows.append(g.detach())
                    del logits, loss
                grads.append(torch.cat(rows))
    finally:
        if handle is not None:
            handle.remove()
    return grads


def _block_fisher(
    block: nn.Module,
    linears: dict[str, nn.Linear],
    inputs: list[torch.Tensor],
    kwargs: list[dict[str, Any]],
    grads: list[torch.Tensor],
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Run ``block`` on its inputs with gradients and carry ``grads`` (of its outputs) back to its
    inputs; each Linear's Σ_t g_t² ⊗ x_t² [out, in] (float32) and the inputs' gradients."""
    fisher = {n: torch.zeros(m.out_features, m.in_features, device=device) for n, m in linears.items()}

    def hook(name: str) -> Callable[..., None]:
        def fn(_module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x2 = args[0].detach().float().square().reshape(-1, args[0].shape[-1])

            def on_grad(g: torch.Tensor) -> None:
                fisher[name].addmm_(g.detach().float().square().reshape(-1, g.shape[-1]).T, x2)

            output.register_hook(on_grad)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        new_grads = []
        for h, kw, g in zip(inputs, kwargs, grads, strict=True):
            x = h.detach().requires_grad_(True)
            with torch.enable_grad():
                out = block(x, **kw)
                out = out[0] if isinstance(out, tuple) else out
                (gx,) = torch.autograd.grad(out, x, g)
            new_grads.append(gx.detach())
    finally:
        for handle in handles:
            handle.remove()
    return fisher, new_grads


TABLE_TOP_ROWS = 1024
TABLE_SAMPLED_ROWS = 1024
"""A table's (token embedding's, output head's) estimate is exact on the TABLE_TOP_ROWS rows that
carry the most of its Fisher mass (the frequent tokens, where nearly all of it sits) and taken on a
systematic sample of TABLE_SAMPLED_ROWS of the other rows (in order of mass), each standing for its
share of them: a table has a row per vocabulary entry, and rounding all of them once per candidate
type would cost more than the rest of the pass."""


@dataclass(frozen=True)
class Tables:
    """The matrices outside the decoder blocks that a budget types too (``target.tables``): an untied
    output head and token embedding, each a choice of its own, or a tied model's one table, which the
    file stores once (token_embd, from the head's record) and the model reads twice (the lookup and
    the logits), so its estimate adds both."""

    head: str | None = None
    embedding: str | None = None
    tied: bool = False
    shared: str | None = None
    """A tied model's token embedding module: the file tensor (token_embd) its one table is."""

    @property
    def names(self) -> list[str]:
        return [n for n in (self.head, self.embedding) if n is not None]

    @property
    def in_file(self) -> list[str]:
        """The modules whose weights the budget types in the file: the tables, and the embedding a tied one table is."""
        return self.names + ([self.shared] if self.shared is not None and self.head is not None else [])

    @property
    def reads_embedding(self) -> bool:
        return self.embedding is not None or (self.tied and self.head is not None)


NO_TABLES = Tables()


def budget_tables(model: nn.Module, taken: set[str]) -> Tables:
    """The tables of ``model`` a budget types: the output head and the token embedding unless a stage
    quantized them already (``taken``); for a tied model the one table, named by its head."""
    embedding = model.get_input_embeddings()
    head = output_head(model)
    if not isinstance(embedding, nn.Embedding):
        return Tables(head=head[0] if head is not None and head[0] not in taken else None)
    embedding_name = next(n for n, m in model.named_modules() if m is embedding)
    if head is not None and head[1].weight is embedding.weight:
        return Tables(head=head[0] if head[0] not in taken and embedding_name not in taken else None, tied=True, shared=embedding_name)
    return Tables(
        head=head[0] if head is not None and head[0] not in taken else None,
        embedding=embedding_name if embedding_name not in taken else None,
    )


def _table_bracket(module: nn.Module, device: torch.device) -> torch.Tensor:
    rows, width = module.weight.shape
    return torch.zeros(rows, width, device=device)


def _embedding_scale(model: nn.Module, tokens: torch.Tensor, hidden: list[torch.Tensor], batch_size: int, label: str) -> float:
    """The factor between an embedding row and block 0's input for its token (1, or Gemma's √width):
    an error on a row reaches the blocks scaled by it. Refused when block 0's input is not a scaled
    lookup (position embeddings added, say): the estimate would not hold."""
    embedding = model.get_input_embeddings()
    with streaming.resident(embedding, hidden[0].device):
        rows = embedding.weight.detach()[tokens[:batch_size].reshape(-1).to(embedding.weight.device)].float()
    h0 = hidden[0].reshape(-1, hidden[0].shape[-1]).float().to(rows.device)
    scale = float((h0 * rows).sum() / (rows * rows).sum().clamp_min(1e-30))
    if float((h0 - scale * rows).norm()) > 1e-2 * float(h0.norm()):
        raise CompressError(
            f"{label}: block 0's input is not a scaled lookup of the token embedding in this model, so the budget cannot "
            "weigh the embedding's rounding; set the export's target.tables: false (the embedding then keeps float_type)"
        )
    return scale


def _table_choice(
    model: nn.Module,
    name: str,
    fisher: torch.Tensor,
    types: list[str],
    n_tokens: int,
    device: torch.device,
    label: str,
    tensor_bytes: TensorBytes,
) -> LayerChoice:
    """A table's options: every candidate type's estimated ΔKL from its bracket ``fisher`` [rows, width],
    on its heaviest rows and a sample of the rest (TABLE_TOP_ROWS, TABLE_SAMPLED_ROWS)."""
    module = model.get_submodule(name)
    order = torch.argsort(fisher.sum(1), descending=True)
    top, rest = order[:TABLE_TOP_ROWS], order[TABLE_TOP_ROWS:]
    stride = max(1, -(-len(rest) // TABLE_SAMPLED_ROWS))
    sample = rest[::stride]
    rows = torch.cat([top, sample])
    share = torch.cat(
        [torch.ones(len(top), device=fisher.device), torch.full((len(sample),), len(rest) / max(1, len(sample)), device=fisher.device)]
    )
    weighed = fisher[rows] * share[:, None]
    with streaming.resident(module, device):
        weight = module.weight.detach()[rows.to(module.weight.device)].to(device)
    shape = tuple(int(n) for n in module.weight.shape)
    options = [
        (t, tensor_bytes(t, shape), 0.5 * float((weighed * _rtn_error(weight, t)).sum()) / n_tokens)
        for t in candidate_types(shape[1], types)
    ]
    if not options:
        raise CompressError(f"{label}: {name} has rows of {shape[1]} weights, which no type of target.types ({', '.join(types)}) divides")
    return LayerChoice(name, shape, sorted(options, key=lambda o: o[1]))


def measure(
    model: nn.Module,
    selected: dict[str, nn.Linear],
    types: list[str],
    tokens: torch.Tensor,
    batch_size: int,
    device: torch.device,
    seed: int,
    reporter: Any,
    label: str,
    tensor_bytes: TensorBytes,
    tables: Tables = NO_TABLES,
) -> list[LayerChoice]:
    """Every selected Linear's options (its candidate types, their bytes in the export's file as
    ``tensor_bytes`` counts them, and estimated ΔKL in nats per token) on the calibration ``tokens``,
    block by block; then those of the ``tables`` (the token embedding, the output head)."""
    arch = architecture_of(model)
    blocks = decoder_blocks(model, arch)
    head = output_head(model)
    if head is not None and head[0] in selected:
        raise CompressError(f"{label}: gguf_target chooses types for the decoder blocks' Linears; keep {head[0]} in `ignore`")
    if expert_linears(model):
        raise CompressError(f"{label}: gguf_target does not measure the fused experts of mixture-of-experts blocks yet; use gguf_type")
    was_training = model.training
    model.eval()
    home = next((p.device for p in model.parameters() if p.device.type != "meta"), device)
    move_outside_blocks(model, arch.blocks, device)
    n_tokens = int(tokens.numel())
    with reporter.status(f"{label} sensitivity: capturing block inputs ({tokens.shape[0]} x {tokens.shape[1]} tokens)"):
        hidden, kwargs = capture_block_inputs(model, blocks, tokens, batch_size, device)
    embed_scale = _embedding_scale(model, tokens, hidden, batch_size, label) if tables.reads_embedding else 1.0
    inputs: list[list[torch.Tensor]] = []
    for i in reporter.track(range(len(blocks)), f"{label} sensitivity: forward", total=len(blocks)):
        with streaming.resident(blocks[i], device) as block:
            inputs.append(hidden)
            hidden = BlockInputs(hidden, kwargs[i]).run(block)
    head_fisher = _table_bracket(model.get_output_embeddings(), device) if tables.head else None
    grads = _head_gradients(model, arch, hidden, device, seed, head_fisher)
    del hidden
    choices: dict[str, LayerChoice] = {}
    for i in reporter.track(reversed(range(len(blocks))), f"{label} sensitivity: backward", total=len(blocks)):
        prefix = f"{arch.blocks}.{i}."
        with streaming.resident(blocks[i], device) as block:
            linears = {n: block.get_submodule(n[len(prefix) :]) for n in selected if n.startswith(prefix)}
            fisher, grads = _block_fisher(block, linears, inputs[i], kwargs[i], grads, device)
            for name, module in linears.items():
                options = []
                shape = (module.out_features, module.in_features)
                stride = _row_stride(module.out_features)
                rows = fisher[name][::stride]
                share = module.out_features / rows.shape[0]
                for type_name in candidate_types(module.in_features, types):
                    error = _rtn_error(module.weight[::stride], type_name)
                    estimate = 0.5 * share * float((rows * error).sum()) / n_tokens
                    options.append((type_name, tensor_bytes(type_name, shape), estimate))
                if not options:
                    raise CompressError(
                        f"{label}: {name} has rows of {module.in_features} weights, which no type of target.types "
                        f"({', '.join(types)}) or its fallback divides"
                    )
                choices[name] = LayerChoice(name, shape, sorted(options, key=lambda o: o[1]))
            del fisher
        inputs[i] = []
    if tables.names:
        embed_fisher = None
        if tables.reads_embedding:  # the lookup's rows: each token's gradient at block 0's input, on its own row
            embedding = model.get_input_embeddings()
            embed_fisher = head_fisher if tables.tied else _table_bracket(embedding, device)
            flat = torch.cat([g.reshape(-1, g.shape[-1]) for g in grads]).float() * embed_scale
            embed_fisher.index_add_(0, tokens.reshape(-1).to(device), flat.square())
        for name, fisher in ((tables.head, head_fisher), (tables.embedding, embed_fisher)):
            if name is not None and fisher is not None:
                choices[name] = _table_choice(model, name, fisher, types, n_tokens, device, label, tensor_bytes)
    move_outside_blocks(model, arch.blocks, home)
    model.train(was_training)
    return [choices[n] for n in selected if n in choices] + [choices[n] for n in tables.names if n in choices]


# --------------------------------------------------------------------------- the budget


def budget_bytes(target: Any, params: int, metadata: int) -> int:
    """The tensor bytes a target allows: bits per weight over every parameter of the file, or the
    file size less its metadata."""
    if target.bits_per_weight is not None:
        return int(target.bits_per_weight * params / 8)
    return int(target.size_mib * 2**20) - metadata


def sensitivities(
    model: nn.Module,
    selected: dict[str, nn.Linear],
    types: list[str],
    tokens: torch.Tensor,
    batch_size: int,
    ctx: Any,
    label: str,
    tensor_bytes: TensorBytes,
    tables: Tables = NO_TABLES,
) -> list[LayerChoice]:
    """``measure``'s options of each layer, or a copy of those ``ctx.sensitivity`` holds for the same
    types, layers, tables, tokens and seed (its keeper vouches that the model and the export format are the same)."""
    cache = ctx.sensitivity
    args = (model, selected, types, tokens, batch_size, ctx.device, ctx.seed, ctx.reporter, label, tensor_bytes, tables)
    if cache is None:
        return measure(*args)
    key_parts = [list(types), sorted(selected), ctx.seed, batch_size] + ([dataclasses.asdict(tables)] if tables.names else [])
    key = hashlib.sha256(json.dumps(key_parts).encode() + tokens.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
    if key not in cache:
        cache[key] = measure(*args)
    return [dataclasses.replace(layer, options=list(layer.options), chosen=0) for layer in cache[key]]


def choose(
    model: nn.Module, selected: dict[str, nn.Linear], budget: SizeBudget, ctx: Any, tokens: torch.Tensor, batch_size: int, label: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """Each selected Linear's GGUF type under the ``budget``'s export target (on the calibration
    ``tokens``; ``ctx`` a RunContext), and the facts for the stage's summary. What the export's file
    holds besides these Linears, and what each option of them takes in it, its format says
    (``ExportFormat.file_layout``)."""
    target = budget.export.target
    tables = budget_tables(model, set(ctx.quantized) | set(selected)) if target.tables else NO_TABLES
    layout = budget.format.file_layout(budget.export, model, ctx.tokenizer, set(selected) | set(tables.in_file))
    fixed, params = layout.fixed_bytes, layout.params
    metadata = layout.metadata_bytes() if target.size_mib is not None else 0
    allowed = budget_bytes(target, params, metadata)
    layers = sensitivities(model, selected, target.types, tokens, batch_size, ctx, label, layout.tensor_bytes, tables)
    try:
        used = allocate(layers, allowed - fixed)
    except CompressError as exc:
        least = fixed + sum(min(o[1] for o in layer.options) for layer in layers)
        raise CompressError(
            f"{label}: the GGUF export's target ({target.describe()}) is below the smallest file these types make: "
            f"{8 * least / params:.3f} bits/weight, {(least + metadata) / 2**20:.2f} MiB ({exc})"
        ) from None
    types = {layer.name: layer.type for layer in layers}
    counts: dict[str, int] = {}
    for t in types.values():
        counts[llama_cpp_spelling(t)] = counts.get(llama_cpp_spelling(t), 0) + 1
    facts = {
        "target": target.model_dump(mode="json"),
        "estimator": "0.5 x sum over weights of the RTN error squared x the diagonal Fisher (sampled-label output gradient "
        "squared x input squared, per token)",
        "sensitivity_tokens": int(tokens.numel()),
        "tensor_bytes": fixed + used,
        "budget_bytes": allowed,
        "bits_per_weight": round(8 * (fixed + used) / params, 4),
        "estimated_kl": _sig(sum(layer.estimate for layer in layers)),
        "type_counts": counts,
        "tables": ({"tied": tables.tied, "names": tables.names} if target.tables else "fixed at float_type"),
        "layers": {
            layer.name: {
                "type": llama_cpp_spelling(layer.type),
                "estimated_kl": _sig(layer.estimate),
                "options": {llama_cpp_spelling(t): _sig(e) for t, _, e in layer.options},
            }
            for layer in layers
        },
    }
    return types, facts


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def layer_schemes(
    model: nn.Module, ctx: Any, cfg: Any, selected: dict[str, nn.Linear], label: str
) -> tuple[Callable[[str], QuantScheme], dict[str, Any] | None]:
    """The scheme of each selected layer for a quantize stage: the stage's own, or, with
    ``gguf_target: true``, the GGUF type the export's budget chooses for the layer (and the facts of
    the choice for the stage's summary)."""
    if not cfg.gguf_target:
        scheme = cfg.scheme()
        return (lambda _name: scheme), None
    budget = ctx.size_budget
    tokens = ctx.calibration()[: budget.export.target.samples]
    batch = getattr(cfg, "batch_size", 8)
    types, facts = choose(model, selected, budget, ctx, tokens, batch, label)
    tables = {name: t for name, t in types.items() if name not in selected}
    if tables:
        facts["table_records"] = quantize_tables(model, ctx, tables, label)
    schemes = {t: QuantScheme(gguf_type=t) for t in set(types.values())}
    return (lambda name: schemes[types[name]]), {"export": budget.export.name, **facts}


def quantize_tables(model: nn.Module, ctx: Any, types: dict[str, str], label: str) -> dict[str, dict[str, Any]]:
    """Round each table (the token embedding, the output head: a tied model's one table is the head's
    record) on the type the budget chose for it, with the quantizers' parameter search, and install
    the record as a stage does for a Linear; the per-table facts for the stage's summary. These
    matrices are looked up or read once per token, so no calibration feeds their rounding, as in llama.cpp."""
    from compress.quantizers.apply import install_record
    from compress.quantizers.grid_search import grid_quantize

    facts = {}
    for name, type_name in types.items():
        module = model.get_submodule(name)
        with streaming.resident(streaming.owner(model, name) or module, write_back=True):
            record = grid_quantize(module.weight.detach().to(ctx.device), QuantScheme(gguf_type=type_name))
            facts[name] = install_record(model, name, module, record, ctx, label)
    return facts
