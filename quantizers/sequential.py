"""Sequential, layer-wise calibration shared by GPTQ and AWQ.

1. Capture what every decoder block receives: one pass over the calibration batches with each
   block replaced by a stand-in that records its inputs and passes hidden states through
   unchanged (the last stand-in stops the pass, so the LM head never runs). Masks and position
   embeddings are recorded per block, so layers with different attention types replay exactly.
2. For each block in order: move it to the compute device, let the method collect statistics
   and quantize it, then run the *quantized* block on its inputs to produce the next block's
   inputs. Only one block lives on the accelerator at a time.
3. When the recipe selects the output head (``lm_head`` out of ``ignore``) and the method can
   quantize it: the head is calibrated like a block's Linear, on the final norm's output of the
   last (quantized) block's output, so it sees exactly what it computes the logits from.

Per block, time and peak memory (CUDA: max allocated; CPU: process peak RSS) are recorded.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compress import streaming
from compress.calibration_checks import check_finite, check_layer_errors
from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.quantizers.apply import quantize_record, select_or_fail, summarize
from compress.quantizers.arch import Architecture, architecture_of, decoder_blocks, output_head, submodule
from compress.quantizers.configs import MoECalibration
from compress.quantizers.moe import calibration_rows, coverage_summary, expert_linears, experts_as_linears
from compress.schema.quantize import WeightQuantConfig


class StopForward(Exception):
    """Raised by a hook to end a forward pass once the inputs it needs are captured."""


class _Recorder(nn.Module):
    """Stands in for a decoder block: records its inputs, returns hidden states unchanged."""

    def __init__(self, index: int, last: bool, hidden: list[torch.Tensor], kwargs: list[list[dict[str, Any]]]) -> None:
        super().__init__()
        self.index, self.last, self.hidden, self.kwargs = index, last, hidden, kwargs

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise CompressError(
                "a decoder block received positional arguments besides hidden_states; layer-wise calibration replays keyword arguments only"
            )
        if self.index == 0:
            self.hidden.append(hidden_states.detach())
        self.kwargs[self.index].append(kwargs)
        if self.last:
            raise StopForward
        return hidden_states


@dataclass
class BlockInputs:
    """Calibration inputs of one block: hidden states per batch and the keyword arguments it receives."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]]

    def run(self, block: nn.Module, keep: bool = True) -> list[torch.Tensor]:
        """The block's outputs per batch; ``keep=False`` runs it for its hooks only and keeps none
        (every calibration token's hidden state again: 201 MB at 128 x 512 x 1536 in bfloat16)."""
        outs = []
        with torch.no_grad():
            for h, kw in zip(self.hidden, self.kwargs, strict=True):
                out = block(h, **kw)
                if keep:
                    outs.append((out[0] if isinstance(out, tuple) else out).detach())
        return outs

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, tokens: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
    """Inputs of block 0 (per batch) and the keyword arguments of every block (per batch)."""
    hidden: list[torch.Tensor] = []
    kwargs: list[list[dict[str, Any]]] = [[] for _ in blocks]
    originals = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = _Recorder(i, i == len(blocks) - 1, hidden, kwargs)
    try:
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch_size):
                try:
                    model(input_ids=tokens[start : start + batch_size].to(device), use_cache=False)
                except StopForward:
                    pass
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    return hidden, kwargs


def move_outside_blocks(model: nn.Module, blocks_path: str, device: torch.device) -> None:
    """Move every parameter and buffer that is not inside a decoder block (embeddings, rotary
    tables, final norm, LM head) to ``device``; blocks stay where they are."""
    prefix = blocks_path + "."
    for name, module in model.named_modules():
        if name == blocks_path or name.startswith(prefix):
            continue
        unit = streaming.unit_of(module)
        if unit is not None:  # streamed: read onto ``device`` when it runs
            unit.device = torch.device(device)
        for _, param in module.named_parameters(recurse=False):
            if param.device.type != "meta":
                param.data = param.data.to(device)
        for key, buf in module.named_buffers(recurse=False):
            if buf.device.type != "meta":
                module._buffers[key] = buf.to(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


@dataclass
class BlockJob:
    """What a method gets for one block."""

    index: int
    block: nn.Module
    linears: dict[str, nn.Linear]  # relative name -> module, only the selected ones
    prefix: str  # e.g. "model.layers.3."
    inputs: BlockInputs
    layer_info: dict[str, dict] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    """Calibration rows of the linears that do not see every token (an MoE expert's: its routed tokens)."""


class HeadInput(nn.Module):
    """Stands in for a block when the output head is calibrated: the final norm, then the head, one
    sequence at a time (a whole batch of logits is batch x seq x vocab floats). Hooks on the head see
    its inputs; the logits are dropped and the hidden states returned unchanged."""

    def __init__(self, norm: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for row in hidden_states:
            self.head(self.norm(row.unsqueeze(0)))
        return hidden_states


def select_block_linears(
    model: nn.Module, cfg: WeightQuantConfig, label: str, method: str, quantizes_head: bool = False
) -> tuple[dict[str, nn.Linear], list[str]]:
    """The Linear layers ``cfg`` selects (inside decoder blocks, and the output head when the method
    ``quantizes_head``; anything else is an error) and the unused ignore patterns. The experts of a
    fused mixture-of-experts block count as one (weightless, meta) Linear per expert matrix
    (quantizers/moe.py), named ``<experts>.<e>.<gate_proj|up_proj|down_proj>``."""
    arch = architecture_of(model)
    blocks = decoder_blocks(model, arch)
    chosen, unused_ignore = select_or_fail(model, cfg, label, extra=expert_linears(model))
    block_names = {f"{arch.blocks}.{i}." for i in range(len(blocks))}
    head = output_head(model)
    head_name = head[0] if head else None
    if head_name in dict(chosen) and not quantizes_head:
        raise CompressError(
            f"{label}: {method} does not quantize the output head ({head_name}) yet, and `ignore` {cfg.ignore} leaves it selected. "
            f"Keep {head_name} in `ignore` (the default), or quantize it with gptq or rtn: a stage with "
            f"`targets: [{head_name}]` and `ignore: []` after this one."
        )
    outside = [n for n, _ in chosen if n != head_name and not any(n.startswith(p) for p in block_names)]
    if outside:
        raise CompressError(
            f"{label}: {method} quantizes Linear layers inside decoder blocks{' and the output head' if quantizes_head else ''}; "
            f"{', '.join(outside[:3])} "
            "is outside them. Add it to `ignore`, and quantize it in a separate `method: rtn` stage if you want it quantized."
        )
    return dict(chosen), unused_ignore


def run_layerwise(
    model: nn.Module,
    ctx: RunContext,
    cfg: WeightQuantConfig,
    label: str,
    method: str,
    process_block: Callable[[BlockJob, Architecture], None],
    batch_size: int,
    extra_summary: dict[str, Any] | None = None,
    quantizes_head: bool = False,
) -> StageRecord:
    """Drive ``process_block`` over the decoder blocks, sequentially, with calibration inputs.

    ``process_block`` collects statistics on ``job.block`` (its ``job.inputs``), quantizes the
    selected linears (installing records with ``install_record``), and fills ``job.layer_info``.
    A method that ``quantizes_head`` also gets the output head, when selected, as one last job: its
    block a ``HeadInput`` (final norm, then head), its prefix empty.
    """
    start = time.perf_counter()
    arch = architecture_of(model)
    blocks = decoder_blocks(model, arch)
    selected, unused_ignore = select_block_linears(model, cfg, label, method, quantizes_head)
    tokens = ctx.calibration()
    device = ctx.device
    was_training = model.training
    model.eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    home = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    move_outside_blocks(model, arch.blocks, device)
    with ctx.reporter.status(f"{label} capturing block inputs ({tokens.shape[0]} x {tokens.shape[1]} calibration tokens)"):
        hidden, kwargs = capture_block_inputs(model, blocks, tokens, batch_size, device)
    finite = check_finite(ctx.checks, hidden, label, f"the input of the first decoder block ({arch.blocks}.0, the embeddings' output)")
    per_block: list[dict[str, Any]] = []
    layer_info: dict[str, dict] = {}
    coverage: list[dict[str, Any]] = []  # routed tokens per expert of each MoE block
    moe = getattr(cfg, "moe", None) or MoECalibration()
    for i in ctx.reporter.track(range(len(blocks)), f"{label} {method} {cfg.describe_scheme()}", total=len(blocks)):
        t0 = time.perf_counter()
        prefix = f"{arch.blocks}.{i}."
        quantizes = any(n.startswith(prefix) for n in selected)
        # A streamed block is read from disk here, and what the method changed is written back on the way out.
        with streaming.resident(blocks[i], device, write_back=quantizes) as block:
            block.to(device)
            inputs = BlockInputs(hidden, kwargs[i])
            with experts_as_linears(block, prefix, i, inputs, moe, label, coverage, selected):
                linears = {n[len(prefix) :]: block.get_submodule(n[len(prefix) :]) for n in selected if n.startswith(prefix)}
                rows = {rel: n for rel in linears if (n := calibration_rows(coverage, prefix + rel)) is not None}
                job = BlockJob(i, block, linears, prefix, inputs, rows=rows)
                if linears:
                    process_block(job, arch)
            hidden = job.inputs.run(block)  # the quantized block feeds the next one
            if finite:  # the first non-finite block is named once
                finite = check_finite(
                    ctx.checks, hidden, label, f"the output of {prefix[:-1]} ({'after quantizing it' if linears else 'not quantized'})"
                )
            if streaming.unit_of(block) is None:
                block.to(home)
        layer_info.update(job.layer_info)
        per_block.append({"block": i, "seconds": round(time.perf_counter() - t0, 3), "peak_memory_mb": round(peak_memory_mb(device), 1)})
    head = output_head(model)
    head_step: dict[str, Any] | None = None
    if head is not None and head[0] in selected:
        t0 = time.perf_counter()
        status = ctx.reporter.status(f"{label} {method} output head {head[0]} (calibrated through {arch.final_norm})")
        norm = submodule(model, arch.final_norm)
        with status, streaming.resident(norm, device), streaming.resident(head[1], device, write_back=True):
            job = BlockJob(len(blocks), HeadInput(norm, head[1]), {head[0]: head[1]}, "", BlockInputs(hidden, [{}] * len(hidden)))
            process_block(job, arch)
        layer_info.update(job.layer_info)
        head_step = {"layer": head[0], "seconds": round(time.perf_counter() - t0, 3), "peak_memory_mb": round(peak_memory_mb(device), 1)}
    move_outside_blocks(model, arch.blocks, home)
    del hidden, kwargs
    model.train(was_training)
    if finite and ctx.checks is not None and ctx.checks.enabled("nonfinite"):
        ctx.checks.record("nonfinite", True, label, 0, 0, f"the hidden states into and out of all {len(blocks)} blocks are finite")
    check_layer_errors(ctx.checks, layer_info, f"{label} {method}")
    summary = summarize(layer_info, unused_ignore, cfg.summary_scheme())
    summary.update(
        calibration_tokens=int(tokens.numel()),
        peak_memory_mb=max([b["peak_memory_mb"] for b in per_block] + ([head_step["peak_memory_mb"]] if head_step else [])),
        blocks=per_block,
        **(extra_summary or {}),
    )
    if head_step is not None:
        summary["head"] = head_step
    if coverage:
        summary["moe"] = coverage_summary(coverage, moe)
        for name, info in layer_info.items():
            rows = calibration_rows(coverage, name)
            if rows is not None:
                info["calibration_tokens"] = rows
    return quantize_record(cfg, start, summary, layer_info, method=method)
