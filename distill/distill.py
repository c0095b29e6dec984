"""The recipe step ``distill: {...}``: repair a pruned (or otherwise changed) model by
distillation from a teacher — by default the model as it was before the prune stage.

First, where MLPs were narrowed, each one's down projection is refitted by least squares to give
the teacher block's MLP output on the teacher's hidden states (distill/refit.py). Training:
forward KL on the logits at a temperature, plus an optional hidden-state loss on mapped layers;
AdamW with linear warmup and cosine decay, gradient accumulation, gradient
clipping, bf16 autocast (CUDA by default; CPUs with bf16 matrix units when asked). The student
is scored against the teacher on held-apart evaluation text every ``eval.every`` steps, a
checkpoint is written every ``checkpoint_every`` steps, and a killed run started again with the
same command resumes from the newest checkpoint. With ``keep_best`` the stage returns the
evaluated weights with the lowest held-apart KL (before the first step, a periodic evaluation,
or the end).

Several processes: ``accelerate launch -m compress run recipe.yaml`` runs the pipeline in every
process; this stage wraps the student with accelerate's DDP, or, with FSDP asked for
(``--use_fsdp``), shards a copy of it with torch's FSDP2 (train.Processes.wrap), each process trains on its own share of every step's batches, and after the last
distill stage only the main process goes on to quantize, export, evaluate and write.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress import streaming
from compress.context import RunContext, StageRecord
from compress.distill import checkpoint
from compress.distill.config import ORIGINAL, DistillConfig
from compress.distill.losses import CosineSchedule
from compress.distill.refit import refit_down_proj, refit_targets
from compress.distill.teacher_store import FOLDER, TeacherLogits
from compress.distill.train import Processes, Trainer, eval_min_context, sample_order
from compress.errors import CompressError

# --------------------------------------------------------------------------- the stage


def layer_map(kept_layers: list[int], teacher_layers: int) -> list[tuple[int, int]]:
    """Pairs of hidden-state indices (student, teacher) that hold the same block's output.
    Index 0 is the embedding output, i+1 block i's; the last entry of a transformers model is
    after the final norm, so a pair is used only when both or neither side is the last block."""
    n = len(kept_layers)
    return [(j + 1, t + 1) for j, t in enumerate(kept_layers) if (j == n - 1) == (t == teacher_layers - 1)]


class DistillStage:
    """The recipe step ``distill: {...}``."""

    def __init__(self, config: DistillConfig, label: str) -> None:
        self.config = config
        self.label = label

    def apply(self, model: nn.Module, ctx: RunContext) -> StageRecord:
        cfg = self.config
        started = time.perf_counter()
        if ctx.quantized:
            raise CompressError(
                f"{self.label} (distill): the model has quantized layers ({next(iter(ctx.quantized))} …); "
                "distillation trains float weights, so put it before the quantize stage"
            )
        if ctx.text is None or (cfg.teacher != ORIGINAL and ctx.load_teacher is None):
            raise CompressError(f"{self.label} (distill): the run context gives no text (or no model loader) to train with")
        teacher, teacher_desc = self._teacher(model, ctx)
        if teacher.config.vocab_size != model.config.vocab_size:
            raise CompressError(
                f"{self.label} (distill): teacher vocabulary ({teacher.config.vocab_size}) differs from the "
                f"student's ({model.config.vocab_size}); a KL loss needs the same tokenizer"
            )
        procs = Processes(ctx.device)
        pairs, channels = self._hidden_mapping(model, teacher, ctx)
        per_step = cfg.batch_size * cfg.grad_accum * procs.world
        cap = cfg.step_cap(procs.world)  # steps, or fewer under max_tokens
        samples = cfg.data.samples or cap * per_step
        train_tokens = ctx.text("calibration", samples, cfg.seq_len, cfg.data.source, cfg.data.seed, cfg.data.text_field)
        eval_tokens = ctx.text("evaluation", cfg.eval.samples, cfg.seq_len, None, None, None)
        device = ctx.device
        use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda")

        stored, scratch = None, None
        if cfg.stored_teacher is not None:  # the teacher's top-k log-probs, once, one block at a time; then it only scores
            teacher_id = ctx.source_sha256 if teacher is ctx.original and ctx.source_sha256 else f"{ctx.run_id}|{self.label}"
            if ctx.work_dir is None:  # outside a run: a folder of its own, removed after the stage
                scratch = Path(tempfile.mkdtemp(prefix="compress-teacher-"))
            work = ctx.work_dir / self.label if ctx.work_dir is not None else scratch
            stored = TeacherLogits(teacher, teacher_id, work / FOLDER, device, cfg.stored_teacher.top_k, cfg.temperature, use_bf16)
            stored.fill(train_tokens, cfg.batch_size, ctx.reporter.track)
        elif streaming.is_streamed(teacher):  # a live teacher runs every step: read into memory once, beside the student
            with ctx.reporter.status(f"{self.label} (distill): reading the teacher into memory"):
                in_memory = streaming.materialize(copy.deepcopy(teacher), device)
            if ctx.teacher is teacher:
                ctx.teacher = in_memory  # the same model: the block mapping of a prune stage still applies
            teacher = in_memory
        streaming.to_device(teacher, device).eval()
        model.to(device)
        trainable = self._trainable(model)
        optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        schedule = CosineSchedule(cfg.warmup_steps, cfg.steps, cfg.final_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        ckpt_dir = ctx.work_dir / self.label if ctx.work_dir is not None else None
        fingerprint = self._fingerprint(model, ctx, procs.world)
        state = checkpoint.TrainState()
        found = checkpoint.latest(ckpt_dir) if ckpt_dir is not None else None
        if found is not None:
            state = checkpoint.load(found, model, optimizer, scheduler, fingerprint)
            ctx.reporter.info(f"{self.label} (distill): resuming from {found} (step {state.step} of {cfg.steps})")
        if procs.mean(float(procs.agree(state.step) != state.step)) > 0:  # every process raises, none waits on the others
            raise CompressError(
                f"{self.label} (distill): the processes found different checkpoints in {ckpt_dir} (this one: step "
                f"{state.step}); on several machines write the run (-o) to a folder every machine shares"
            )
        trainer = Trainer(
            cfg,
            self.label,
            model,
            teacher,
            procs,
            optimizer,
            scheduler,
            schedule,
            trainable,
            state,
            train_tokens,
            eval_tokens,
            device,
            use_bf16,
            pairs,
            channels,
            ckpt_dir,
            fingerprint,
            ctx.reporter,
            self._refit(model, teacher, ctx, train_tokens, use_bf16) if found is None else None,
            stored,
        )
        try:
            trainer.run()
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        procs.gather(trainer.wrapped, model)
        model.eval().requires_grad_(False)
        model.to("cpu")
        streaming.to_device(teacher, "cpu")
        stopped_by = "steps" if state.step >= cfg.steps else "max_tokens" if state.step >= cap else "max_minutes"
        first, final = state.history[0], state.history[-1]
        kept = final if state.best is None else state.history[state.best]
        refitted = next((point for point in state.history if "refit" in point), None)
        summary = {
            "teacher": teacher_desc,
            "stored_teacher": None if stored is None else stored.facts(),
            "steps": state.step,
            "max_steps": cfg.steps,
            "max_minutes": cfg.max_minutes,
            "max_tokens": cfg.max_tokens,
            "stopped_by": stopped_by,
            "loop_seconds": round(state.wall_seconds, 2),
            "processes": procs.world,
            "parallel": procs.kind,
            "tokens": state.tokens,
            "train_seconds": round(state.seconds, 2),
            "tokens_per_second": round(state.tokens / state.seconds, 1) if state.seconds else None,
            "resumed_from_step": state.resumed_from,
            "autocast": "bf16" if use_bf16 else "off",
            "hidden_loss_layers": len(pairs),
            "training_data": {
                "source": cfg.data.source or "data.calibration",
                "chunks": int(train_tokens.shape[0]),
                "seq_len": cfg.seq_len,
                "epochs": round(state.step * per_step / train_tokens.shape[0], 3),
            },
            "held_apart_eval": {
                "chunks": cfg.eval.samples,
                "seq_len": cfg.seq_len,
                "min_context": eval_min_context(cfg.seq_len),
                "against": "the teacher",
            },
            "before": {k: first[k] for k in ("kl_divergence", "top1_agreement", "perplexity")},
            "refit": None
            if refitted is None
            else {**refitted["refit"], **{k: refitted[k] for k in ("kl_divergence", "top1_agreement", "perplexity")}},
            "after": {k: kept[k] for k in ("kl_divergence", "top1_agreement", "perplexity")},
            "kept_step": kept["step"],
            "history": state.history,
        }
        ctx.reporter.info(
            f"{self.label} (distill): KL to the teacher {first['kl_divergence']:.4f} → {final['kl_divergence']:.4f} "
            f"in {state.step} steps, {state.tokens:,} tokens, {state.wall_seconds:.0f} s"
            + (
                ""
                if stopped_by == "steps"
                else f" (the budget of {cfg.max_tokens:,} tokens ended it before step {cfg.steps})"
                if stopped_by == "max_tokens"
                else f" (the {cfg.max_minutes:g}-minute budget ended it before step {cfg.steps})"
            )
        )
        if kept is not final:
            when = "from before the first step" if kept["step"] == 0 else f"of step {kept['step']}"
            ctx.reporter.warn(
                f"{self.label} (distill): training raised the held-apart KL from its best, {kept['kl_divergence']:.4f}; "
                f"the stage returns the weights {when} (keep_best)"
            )
        return StageRecord("distill", cfg.loss, cfg.model_dump(mode="json"), time.perf_counter() - started, summary)

    def _teacher(self, model: nn.Module, ctx: RunContext) -> tuple[nn.Module, str]:
        if self.config.teacher != ORIGINAL:
            return ctx.load_teacher(self.config.teacher), self.config.teacher
        if ctx.teacher is not None:
            return ctx.teacher, "the model before pruning"
        teacher = ctx.frozen_copy(model)  # no prune stage: the model as this stage receives it teaches
        return teacher, "the model as loaded" if teacher is ctx.original else "the model as this stage received it"

    def _block_mapping(self, model: nn.Module, teacher: nn.Module, ctx: RunContext) -> tuple[list[int], torch.Tensor | None] | None:
        """(teacher block of each student block, kept hidden channels or None), or None when unknown."""
        kept = ctx.mapping
        if kept is not None and teacher is ctx.teacher:
            return kept.layers, kept.hidden
        if model.config.num_hidden_layers != teacher.config.num_hidden_layers or model.config.hidden_size != teacher.config.hidden_size:
            return None
        return list(range(model.config.num_hidden_layers)), None

    def _hidden_mapping(self, model: nn.Module, teacher: nn.Module, ctx: RunContext) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        if self.config.hidden_loss_weight == 0:
            return [], None
        mapping = self._block_mapping(model, teacher, ctx)
        if mapping is None:
            raise CompressError(
                f"{self.label} (distill): hidden_loss_weight needs to know which teacher layer and channel each "
                "student one matches; that is known for teacher: original after a prune stage, or when both "
                f"have the same shape (student {model.config.num_hidden_layers} x {model.config.hidden_size}, "
                f"teacher {teacher.config.num_hidden_layers} x {teacher.config.hidden_size})"
            )
        return layer_map(mapping[0], teacher.config.num_hidden_layers), mapping[1]

    def _refit(
        self, model: nn.Module, teacher: nn.Module, ctx: RunContext, train_tokens: torch.Tensor, use_bf16: bool
    ) -> Callable[[], dict[str, Any]] | None:
        """The least-squares refit as the trainer runs it before step 1, or None when it has nothing to do."""
        cfg = self.config
        if cfg.refit is None or cfg.stored_teacher is not None:  # a stored teacher has no hidden states to fit to
            return None
        mapping = self._block_mapping(model, teacher, ctx)
        if mapping is None:
            if "refit" in cfg.model_fields_set:
                raise CompressError(
                    f"{self.label} (distill): refit needs to know which teacher block each student block matches; "
                    "that is known for teacher: original after a prune stage, or the same number of layers and "
                    "hidden size (or set refit: null)"
                )
            return None
        layers, channels = mapping
        if channels is not None:  # hidden channels pruned: measured worse on a tiny model (module docstring)
            if "refit" in cfg.model_fields_set:
                raise CompressError(
                    f"{self.label} (distill): refit fits MLPs on the teacher's hidden states, which the student no "
                    "longer has once hidden channels are pruned (it made the KL worse there); set refit: null"
                )
            return None
        if not refit_targets(model, teacher, layers):
            return None
        if cfg.teacher == ORIGINAL and getattr(ctx.mapping, "mlp_refitted", False) and "refit" not in cfg.model_fields_set:
            return None  # prune's mlp_method obs fitted these columns already, to the same target (a second fit gains nothing)
        order = sample_order(train_tokens.shape[0], cfg.data.seed, 0)[: cfg.refit.samples]
        tokens = train_tokens[list(order)]

        def run() -> dict[str, Any]:
            report = refit_down_proj(
                model, teacher, tokens, layers, cfg.refit.damp, cfg.batch_size, ctx.device, use_bf16, ctx.reporter.track
            )
            return {"blocks": report.blocks, "tokens": report.tokens, "seconds": round(report.seconds, 2), "damp": cfg.refit.damp}

        return run

    def _trainable(self, model: nn.Module) -> list[nn.Parameter]:
        frozen = set()
        if self.config.train == "blocks":
            frozen = {id(model.get_input_embeddings().weight)}
            out = model.get_output_embeddings()
            if out is not None:
                frozen.add(id(out.weight))
        params = []
        for p in {id(p): p for p in model.parameters()}.values():
            p.requires_grad_(id(p) not in frozen)
            if id(p) not in frozen:
                params.append(p)
        return params

    def _fingerprint(self, model: nn.Module, ctx: RunContext, world: int) -> str:
        shapes = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
        text = f"{ctx.run_id}|{self.label}|{world}|{shapes}"
        return hashlib.sha256(text.encode()).hexdigest()
