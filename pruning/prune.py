"""The recipe step ``prune: {mlp, heads, hidden, layers}``: importance from calibration
activations, then slicing to a smaller dense model (see importance.py and slicing.py).

Targets: a number in (0, 1) is the share to remove (``mlp: 0.25`` removes a quarter of every
MLP's neurons); ``{size: N}`` is the size to keep (``mlp: {size: 1152}``). Heads count query
heads and are removed a KV group at a time; MLP and hidden sizes are rounded down to
``multiple_of`` so that the pruned widths stay exportable (GGUF blocks of 32 along rows).
Blocks: ``layers: {drop: 4}`` or ``layers: {size: 26}``, least important first by ``metric``.

All scores come from the unpruned model in one pass, then every axis is cut: blocks first,
then MLP neurons and KV groups per kept block, then embedding channels. ``mlp_method: obs``
chooses the MLP neurons by structured OBS instead (obs.py: the same pass also sums each block's
aᵀa) and updates the kept down_proj columns; ``data`` gives the pass other text than
data.calibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from compress import streaming
from compress.context import RunContext, StageRecord
from compress.errors import CompressError
from compress.pruning.arch import PrunableModel
from compress.pruning.config import PruneConfig, SizeTarget
from compress.pruning.importance import Importance, collect, top_indices
from compress.pruning.obs import obs_cut
from compress.pruning.slicing import drop_layers, kv_groups_config, prune_hidden, slice_block_kv_groups, slice_block_mlp


def _round_down(n: float, multiple: int) -> int:
    return int(n // multiple) * multiple


def resolve_sizes(config: PruneConfig, pm: PrunableModel) -> dict[str, int]:
    """Sizes to keep, by config key (only the axes the config names). Errors say what is possible."""
    sizes: dict[str, int] = {}
    per_group = pm.num_heads // pm.kv_heads
    for name, full, multiple in (
        ("mlp", pm.intermediate_size, config.multiple_of),
        ("hidden", pm.hidden_size, config.multiple_of),
        ("heads", pm.num_heads, per_group),
    ):
        target = getattr(config, name)
        if target is None:
            continue
        keep = target.size if isinstance(target, SizeTarget) else full * (1 - target)
        if isinstance(target, SizeTarget) and target.size % multiple:
            raise CompressError(
                f"prune.{name}: size {target.size} is not a multiple of {multiple}"
                + (
                    f" (query heads per KV group: {pm.num_heads} heads share {pm.kv_heads} KV heads)"
                    if name == "heads"
                    else " (prune.multiple_of)"
                )
            )
        kept = _round_down(keep, multiple) if name != "heads" else int(round(keep / multiple)) * multiple
        if not 0 < kept <= full:
            raise CompressError(f"prune.{name}: keeps {kept} of {full}; the target must leave between {multiple} and {full}")
        sizes[name] = kept
    if "hidden" in sizes:
        sizes["hidden"] = _hidden_the_config_accepts(pm, sizes, config.multiple_of, isinstance(config.hidden, SizeTarget))
    if config.layers is not None:
        n = len(pm.blocks)
        kept = n - config.layers.drop if config.layers.drop is not None else config.layers.size
        if not 0 < kept <= n:
            raise CompressError(f"prune.layers: keeps {kept} of {n} blocks; it must keep at least one and at most {n}")
        sizes["layers"] = kept
    return sizes


def _hidden_the_config_accepts(pm: PrunableModel, sizes: dict[str, int], multiple: int, exact: bool) -> int:
    """The largest hidden size <= the target (a multiple of ``multiple``) that the model's config
    class accepts with the new head count: some (Llama's) insist that hidden_size is a multiple
    of num_attention_heads even with an explicit head_dim."""
    heads = sizes.get("heads", pm.num_heads)
    base = {
        **pm.config.to_dict(),
        "num_attention_heads": heads,
        "num_key_value_heads": heads // (pm.num_heads // pm.kv_heads),
        "head_dim": pm.head_dim,
    }
    size = sizes["hidden"]
    while size > 0:
        try:
            pm.config.__class__.from_dict({**base, "hidden_size": size})
            return size
        except (ValueError, TypeError) as exc:
            if exact:
                raise CompressError(f"prune.hidden: size {size} is refused by {type(pm.config).__name__}: {exc}") from None
        size -= multiple
    raise CompressError(
        f"prune.hidden: no multiple of {multiple} up to {sizes['hidden']} is accepted by {type(pm.config).__name__} "
        f"with {heads} attention heads; choose another size or multiple_of"
    )


def parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class PruneStage:
    """The recipe step ``prune: {...}``."""

    def __init__(self, config: PruneConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: torch.nn.Module, ctx: RunContext) -> StageRecord:
        from compress.data import Chunks  # compress.data imports the recipe, which imports this module

        started = time.perf_counter()
        pm = PrunableModel.of(model)
        if ctx.quantized:
            raise CompressError(
                f"{self.label} (prune): the model already has quantized layers ({next(iter(ctx.quantized))} …); "
                "prune before quantizing (put the prune stage first)"
            )
        before_shape, before_params = pm.shape(), parameters(model)
        sizes = resolve_sizes(self.config, pm)
        ctx.keep_teacher(model)  # the model before pruning teaches a later distill stage
        tokens = self._tokens(ctx)
        batches = list(tokens.split(self.config.batch_size))
        device = ctx.device
        streaming.to_device(model, device)  # a streamed model scores one block at a time
        obs = self.config.mlp_method == "obs"
        imp = collect(
            pm,
            batches,
            device,
            want_hidden="hidden" in sizes,
            layer_metric=self.config.layers.metric if self.config.layers else None,
            progress=ctx.reporter.track,
            want_gram=obs,
        )
        if obs and imp.tokens < 8 * pm.intermediate_size:
            ctx.reporter.warn(
                f"{self.label} (prune): mlp_method obs fits {pm.intermediate_size} neurons a block from {imp.tokens:,} "
                "tokens; with fewer than 8 tokens a neuron the fit follows this text and can hurt other text "
                "(give data: more samples)"
            )
        cut_started = time.perf_counter()
        if streaming.is_streamed(model) and "hidden" in sizes:  # channels cross every unit: cut in memory (_cut)
            with ctx.reporter.status(f"{self.label} (prune): reading the whole model into memory to cut embedding channels"):
                streaming.materialize(model, device)
        kept, obs_removed = self._cut(pm, imp, sizes, self.config.obs_damp if obs else None, ctx.reporter.track, device)
        cut_seconds = time.perf_counter() - cut_started
        imp.mlp_gram = []  # 30 x 1536² float64 for SmolLM2: not kept past the cut
        streaming.to_device(model, "cpu")
        ctx.mapping = kept  # student -> teacher indices, for a hidden-state distillation loss
        ctx.files[f"pruning/{self.label}.safetensors"] = {
            **imp.tensors(),
            **{f"kept.{k}": v for k, v in kept.tensor_items()},
            **{f"obs_removed.mlp.layers.{i}": r for i, r in enumerate(obs_removed)},
        }
        after_params = parameters(model)
        summary: dict[str, Any] = {
            "before": {**before_shape, "parameters": before_params},
            "after": {**pm.shape(), "parameters": after_params},
            "removed_parameters_pct": round(100 * (1 - after_params / before_params), 2),
            "dropped_layers": [i for i in range(before_shape["num_hidden_layers"]) if i not in kept.layers],
            "importance": {
                "calibration_tokens": imp.tokens,
                "file": f"pruning/{self.label}.safetensors",
                "text": "data.calibration" if self.config.data is None else self.config.data.source,
                "tokens_sha256": Chunks("calibration", tokens).sha256,
                "layer_metric": self.config.layers.metric if self.config.layers else None,
                "mlp_method": self.config.mlp_method if "mlp" in sizes else None,
            },
        }
        if obs:
            summary["obs"] = {"damp": self.config.obs_damp, "seconds": round(cut_seconds, 1)}
        ctx.reporter.info(
            f"{self.label} (prune): {before_params:,} → {after_params:,} parameters "
            f"({summary['removed_parameters_pct']}% removed); shape {pm.shape()}"
        )
        return StageRecord(
            "prune", "minitron+obs" if obs else "minitron", self.config.model_dump(mode="json"), time.perf_counter() - started, summary
        )

    def _tokens(self, ctx: RunContext) -> torch.Tensor:
        """The importance pass's chunks: data.calibration's, or ``data``'s (in the calibration role)."""
        data = self.config.data
        if data is None:
            return ctx.calibration()
        if ctx.text is None:
            raise CompressError(f"{self.label} (prune): data: this run gives no text loader")
        samples, seq_len = data.samples, data.seq_len
        if samples is None or seq_len is None:
            base = ctx.calibration()
            samples, seq_len = samples or int(base.shape[0]), seq_len or int(base.shape[1])
        return ctx.text("calibration", samples, seq_len, data.source, data.seed, data.text_field)

    @staticmethod
    def _cut(
        pm: PrunableModel,
        imp: Importance,
        sizes: dict[str, int],
        obs_damp: float | None = None,
        progress: Callable[..., Iterable] | None = None,
        device: torch.device | None = None,
    ) -> tuple[KeptIndices, list[torch.Tensor]]:
        """Cut every axis; returns what was kept and, with ``obs_damp`` (mlp_method obs), each kept
        block's MLP neurons in the order the search removed them.

        Blocks, MLP neurons and KV groups are cut one block at a time: on a streamed model each
        block is read, sliced and written to the overlay under its new name (its place after the
        dropped blocks) with ``streaming.resident(..., write_back=True)``, so only one block is in
        memory; embedding channels touch every unit and the tied head, and are cut on the model
        in memory (the stage reads it whole first)."""
        n = len(pm.blocks)
        layers = list(range(n))
        prefixes = [streaming.unit_of(b).prefix if streaming.unit_of(b) else None for b in pm.blocks]  # type: ignore[union-attr]
        if "layers" in sizes:
            scores = imp.layers_cosine if imp.layers_cosine is not None else imp.layers_kl
            assert scores is not None
            layers = top_indices(scores, sizes["layers"]).tolist()
            drop_layers(pm, [i for i in range(n) if i not in layers])
        kept = KeptIndices(layers=layers)
        removed: list[torch.Tensor] = []
        hd, per_group = pm.head_dim, pm.num_heads // pm.kv_heads
        groups = sizes["heads"] // per_group if "heads" in sizes else 0
        obs = "mlp" in sizes and obs_damp is not None
        kept.mlp_refitted = obs
        positions = list(zip(layers, pm.blocks, strict=True))
        label = "pruning: OBS selection" if obs else "pruning: slicing"
        for j, (i, block) in enumerate(progress(positions, label, len(positions)) if progress else positions):
            unit = streaming.unit_of(block)
            renamed = unit is not None and prefixes[i] is not None and j != i
            if not (renamed or "mlp" in sizes or "heads" in sizes):
                continue
            with streaming.resident(block, device, write_back=True), torch.no_grad():
                if "mlp" in sizes and obs:
                    assert obs_damp is not None
                    cut = obs_cut(imp.mlp_gram[i], pm.down_proj(block).weight, sizes["mlp"], obs_damp)
                    slice_block_mlp(block, cut.kept)
                    weight = pm.down_proj(block).weight
                    weight.copy_(cut.weight.to(weight.dtype))
                    kept.mlp.append(cut.kept)
                    removed.append(cut.removed)
                elif "mlp" in sizes:
                    kept.mlp.append(top_indices(imp.mlp[i], sizes["mlp"]))
                    slice_block_mlp(block, kept.mlp[-1])
                if "heads" in sizes:
                    kept.kv_groups.append(top_indices(imp.group_scores(i, pm.kv_heads), groups))
                    slice_block_kv_groups(block, kept.kv_groups[-1], hd, per_group)
                if renamed:  # written back under the name of its new place
                    unit.prefix = f"{prefixes[i].rsplit('.', 1)[0]}.{j}"  # type: ignore[union-attr]
        if "mlp" in sizes:
            pm.config.intermediate_size = sizes["mlp"]
        if "heads" in sizes:
            kv_groups_config(pm, groups, hd, per_group)
        if "hidden" in sizes:
            assert imp.hidden is not None
            kept.hidden = top_indices(imp.hidden, sizes["hidden"])
            prune_hidden(pm, kept.hidden)
        return kept, removed


@dataclass
class KeptIndices:
    """What pruning kept, as indices into the unpruned model (a distillation loss maps student
    layers and channels back to the teacher's with these)."""

    layers: list[int]
    hidden: torch.Tensor | None = None
    mlp: list[torch.Tensor] = field(default_factory=list)
    kv_groups: list[torch.Tensor] = field(default_factory=list)
    mlp_refitted: bool = False  # the kept down_proj columns were fitted by least squares (mlp_method obs)

    def tensor_items(self) -> list[tuple[str, torch.Tensor]]:
        items = [("layers", torch.tensor(self.layers, dtype=torch.long))]
        if self.hidden is not None:
            items.append(("hidden", self.hidden))
        items += [(f"mlp.layers.{i}", t) for i, t in enumerate(self.mlp)]
        items += [(f"kv_groups.layers.{i}", t) for i, t in enumerate(self.kv_groups)]
        return items
