"""The recipe's ``distill:`` stage: the teacher, the training loop's settings, its text and its checks.

Torch-free; the losses, the training loop and the stage live in compress/distill/.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from compress.schema.base import BaseStageConfig, Seed
from compress.schema.base import Strict as _Strict

ORIGINAL = "original"


class DistillData(_Strict):
    source: str | list[str] | None = Field(
        None,
        description="Training text (file, directory, glob or reference:<name>), or a list of them sharing the chunks "
        "equally; default: data.calibration.source. Kept apart from data.evaluation like calibration text.",
    )
    samples: int | None = Field(
        None,
        ge=1,
        description="Training chunks; default: exactly what the steps consume "
        "(steps x batch_size x grad_accum x processes). Fewer chunks are repeated in new orders (epochs).",
    )
    seed: Seed = Field(0, description="Seed for choosing and ordering the chunks.")
    text_field: str = Field("text", description="Field holding the text in .jsonl records.")


class DistillEval(_Strict):
    every: int = Field(
        50, ge=0, description="Score the student against the teacher every this many steps (and at the end); 0: only at the end."
    )
    samples: int = Field(4, ge=1, description="Chunks of data.evaluation text (seq_len tokens each) to score on.")


class DistillRefit(_Strict):
    samples: int = Field(
        64,
        ge=1,
        description="Chunks of the training text (seq_len tokens each) the fit reads: the first "
        "steps' chunks, in the order training takes them (at most the data.samples there are).",
    )
    damp: float = Field(0.1, gt=0, description="Ridge towards the pruned weights, as a share of the mean squared activation.")


class StoredTeacher(_Strict):
    top_k: int = Field(
        64,
        ge=1,
        description="Teacher log-probs kept per position: the k most likely tokens (values and token ids) and the "
        "log of the probability left over the rest of the vocabulary (one bucket). A k at least the vocabulary keeps "
        "every token: the loss is then the full KL.",
    )


class DistillConfig(BaseStageConfig):
    """`distill: {teacher, steps, batch_size, seq_len, lr, temperature, loss, hidden_loss_weight, data, ...}`."""

    calibration_hint: ClassVar[str] = " (or its own distill.data.source)"
    needs_evaluation_to: ClassVar[str | None] = "scores the student on held-apart text"
    before_quantization: ClassVar[bool] = True

    teacher: str = Field(
        ORIGINAL,
        description="original: the model before the prune stage (or as loaded when no stage "
        "changed it); otherwise a model source like model.source (same tokenizer).",
    )
    stored_teacher: StoredTeacher | None = Field(
        None,
        description="Train on the teacher's top-k log-probs, computed once on the training chunks (the teacher read "
        "one block at a time from disk) and kept under OUTPUT.work/teacher/, instead of running the teacher beside the "
        "student each step: for a teacher that does not fit in memory beside the student. The KL is taken over the "
        "top_k tokens plus one bucket for the rest (distill/losses.py). Needs hidden_loss_weight 0 and no refit (both "
        "read the teacher's hidden states live). null: the live teacher, in memory beside the student.",
    )
    steps: int = Field(ge=1, description="Optimizer steps (at most this many under max_minutes or max_tokens).")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Training-token budget (all processes together): the stage runs at most the steps whose tokens fit "
        "(at least one), and the cosine decay ends there. With max_minutes too, whichever ends first. null: no token budget.",
    )
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="Wall-clock budget of the training loop (steps, evaluations, checkpoints; a resumed run "
        "counts the time up to its checkpoint): after the first 3 steps the stage plans how many of `steps` fit, the cosine "
        "decay ends there, and no step starts that would end past the budget. null: exactly `steps`.",
    )
    batch_size: int = Field(4, ge=1, description="Chunks per forward pass, per process.")
    grad_accum: int = Field(1, ge=1, description="Forward passes per optimizer step.")
    seq_len: int = Field(256, ge=8, description="Tokens per training chunk.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    final_lr_ratio: float = Field(0.1, ge=0, le=1, description="Learning rate at the last step, as a share of lr (cosine decay).")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the gradient norm to this (null: no clipping).")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the KL loss (scaled by T²).")
    loss: Literal["kl", "ce"] = Field(
        "kl",
        description="kl: forward KL(teacher || student) on the logits (distillation); ce: cross-entropy on the training "
        "text's next tokens (plain fine-tuning: the teacher does not run during the steps, it only scores the held-apart "
        "evaluations and feeds the refit).",
    )
    hidden_loss_weight: float = Field(0.0, ge=0, description="Weight of the hidden-state loss on mapped layers (0: off).")
    refit: DistillRefit | None = Field(
        default_factory=DistillRefit,
        description="Before training, fit each pruned MLP's down projection by least squares "
        "so that, fed the teacher's hidden states, it gives the teacher block's MLP output (distill/refit.py). Only blocks "
        "whose MLP is narrower than their teacher block's change, and only when the hidden channels were not pruned; it "
        "needs to know which teacher block each student one matches (teacher: original after a prune stage, or the same "
        "number of layers and hidden size). Skipped unless set explicitly after a prune stage with mlp_method obs, which "
        "fits the same columns to the same target. null: off.",
    )
    train: Literal["blocks", "all"] = Field(
        "blocks",
        description="blocks: the decoder blocks and norms learn, the embedding and output head stay frozen "
        "(faster; they are the largest matrices of a small model); all: every parameter learns.",
    )
    autocast: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description="auto: bf16 autocast on CUDA, float32 on CPU; bf16: also on CPU (fast on CPUs with AMX / "
        "AVX512-BF16); off: float32 everywhere.",
    )
    data: DistillData = Field(default_factory=DistillData)
    eval: DistillEval = Field(default_factory=DistillEval)
    checkpoint_every: int = Field(50, ge=0, description="Write a resumable checkpoint every this many steps (0: never).")
    keep_best: bool = Field(
        True,
        description="Return the weights that scored the lowest held-apart KL: those before the first step (after the "
        "refit), at a periodic evaluation, or at the end. Training can make a student that starts close to its teacher "
        "worse; false: always the weights of the last step.",
    )

    @field_validator("autocast", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _warmup_fits(self) -> DistillConfig:
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be fewer than steps ({self.steps})")
        return self

    @model_validator(mode="after")
    def _ce_trains_on_text(self) -> DistillConfig:
        if self.loss == "ce" and (self.stored_teacher is not None or self.hidden_loss_weight > 0):
            key = "stored_teacher" if self.stored_teacher is not None else f"hidden_loss_weight ({self.hidden_loss_weight:g})"
            raise ValueError(f"loss ce trains on the text alone, without the teacher's outputs; remove {key} or use loss: kl")
        return self

    @model_validator(mode="after")
    def _stored_teacher_is_logits_only(self) -> DistillConfig:
        if self.stored_teacher is None:
            return self
        live = []
        if self.hidden_loss_weight > 0:
            live.append(f"hidden_loss_weight ({self.hidden_loss_weight:g})")
        if "refit" in self.model_fields_set and self.refit is not None:
            live.append("refit")
        if live:
            raise ValueError(
                f"stored_teacher keeps only the teacher's log-probs, but {' and '.join(live)} read the teacher's hidden "
                "states, which need a live teacher; set hidden_loss_weight: 0 and refit: null, or remove stored_teacher"
            )
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.data.source is None

    def tokens_per_step(self, processes: int = 1) -> int:
        return self.batch_size * self.grad_accum * processes * self.seq_len

    def step_cap(self, processes: int = 1) -> int:
        """``steps``, or fewer under ``max_tokens``: the steps whose tokens fit the budget (at least one)."""
        if self.max_tokens is None:
            return self.steps
        return min(self.steps, max(1, self.max_tokens // self.tokens_per_step(processes)))
