"""What `compress plan` estimates a stage from: the reference machine's throughputs, the shared
formulas (a forward pass, its activations, training activations), and the typed inputs and
output of one stage's estimate. Torch-free, so that the QuantMethod and StageKind objects (compress.plugins)
can hold their own formulas; eval/plan/planner.py adds the rows for loading, evaluation and exports.

Every number is an estimate: throughputs measured on this project's reference machine (2 CPU
cores, torch 2.13 CPU, 2 threads, SmolLM2-135M), scaled by parameters and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Measured on the reference machine (docs/benchmarks.md, docs/bench/*.json, the runs' manifest.json).
REFERENCE = "rough numbers of this project's 2-core CPU (torch 2.13, 2 threads); other machines differ"
REF_PARAMS = 134_515_008  # SmolLM2-135M
CPU_FORWARD_FLOPS = 160e9  # quickstart evaluation: 2 models x 32 x 512 tokens in 54 s (2 x params FLOPs/token)
LOAD_BYTES_PER_S = 0.2e9  # the 538 MB float32 model (cached conversion) loaded in 2.7 s
RTN_WEIGHTS_PER_S = 1.0e8  # RTN: 106M weights in ~1.0 s
DISTILL_TOKENS_PER_S = {"bf16": 250.0, "fp32": 124.0}  # distillation training of the 135M model
TORCH_DECODE_TOKENS_PER_S = 18.0  # token-by-token torch decoding with a DynamicCache, 135M model, fp32
EXPORT_BUILD_S = 60.0  # writing and proving one export file of the 135M model, without scoring it (onnx.yaml: ~110 s per export)


@dataclass(frozen=True)
class Estimate:
    """One plan row's numbers: peak memory (bytes), time (seconds), and how they were reached."""

    memory_bytes: float
    seconds: float
    basis: str


@dataclass(frozen=True)
class PlanStep:
    """What one stage's estimate may read (built by eval/plan/planner.py for each stage in turn)."""

    config: Any
    """The stage's validated config (``stage.config`` of the recipe)."""
    shape: Any
    """The model as this stage sees it (``compress.eval.plan.shapes.ModelShape``: ``params``,
    ``text`` config, ``config``, the meta-device ``model``, ``frozen_params()``)."""
    held_bytes: float
    """What is in memory before the stage adds its own: the libraries and, for a stage that streams,
    one unit (the largest of a decoder block and the embedding), else the whole model at the model dtype."""
    calibration: Any
    """The recipe's ``data.calibration`` (``samples``, ``seq_len``), or None."""
    kv_bytes_per_token: int
    """KV-cache bytes one token adds to the model as this stage sees it, at the model dtype."""
    records: dict[str, Any]
    """The plan's quantized Linear layers of the final model (``Record``: ``out_f``, ``in_f``, ``scheme``)."""
    dtype_bytes: int = 4
    """Bytes per value at the run's compute dtype (``model.dtype``, ``auto`` resolved)."""
    streamed: bool = True
    """Whether the model still streams at this stage (``held_bytes`` then holds one unit, not the model)."""

    @property
    def cal_tokens(self) -> int:
        return self.calibration.samples * self.calibration.seq_len if self.calibration else 0

    @property
    def cal_seq_len(self) -> int:
        return self.calibration.seq_len if self.calibration else 0


LIBRARY_BYTES = 0.5e9
"""Resident memory of the libraries a run imports: 481 MB measured after importing torch,
transformers and compress's CLI and pipeline, 506 MB with onnxruntime, llama_cpp and gguf
(torch 2.13 CPU, transformers 5.17, VmRSS of a fresh process)."""


RUN_STATE_BYTES = 0.2e9
"""What a run holds beyond the imports once it has opened the model: the tokenizer, the token ids,
the records' index, the heap the allocator keeps. Measured on Qwen2.5-Coder-1.5B cut to 4 blocks
(the load phase peaks at 686 MiB with no weights read, against 481 MB for the imports alone)."""


def block_weight_bytes(shape: Any, dtype_bytes: int) -> float:
    """One decoder block's weights (the parameters outside the embedding and head, over the blocks)."""
    t = shape.text
    tied = getattr(shape.config, "tie_word_embeddings", getattr(t, "tie_word_embeddings", True))
    return (shape.params - t.vocab_size * t.hidden_size * (1 if tied else 2)) / max(t.num_hidden_layers, 1) * dtype_bytes


def largest_unit_bytes(shape: Any, dtype_bytes: int) -> float:
    """The largest unit a streamed model reads at once: one decoder block, or the token embedding
    (the output head, when untied, is the same size)."""
    t = shape.text
    return max(block_weight_bytes(shape, dtype_bytes), t.vocab_size * t.hidden_size * dtype_bytes)


def block_bytes(shape: Any, batch: int, seq: int, dtype_bytes: int) -> float:
    """One decoder block's live tensors in a forward pass of ``batch`` x ``seq`` tokens at the compute
    dtype (its inputs, attention projections and MLP intermediates), plus the float32 attention scores."""
    t = shape.text
    return batch * seq * (4 * t.hidden_size + 3 * t.intermediate_size) * dtype_bytes + batch * t.num_attention_heads * seq * seq * 4


def eval_bytes(shape: Any, batch: int, seq: int, dtype_bytes: int) -> float:
    """Evaluating one batch on a streamed model: one block's live tensors at the compute dtype, the
    batch's hidden states for the baseline and the compressed model, and logits built a chunk of
    positions at a time (about five float32 buffers of CHUNK_ELEMENTS values: logits, log-probs of
    both models, their difference, the exponent)."""
    from compress.eval.metrics import CHUNK_ELEMENTS

    t = shape.text
    return block_bytes(shape, batch, seq, dtype_bytes) + 2 * batch * seq * t.hidden_size * 4 + 5 * CHUNK_ELEMENTS * 4


def forward_s(params: int, tokens: float) -> float:
    """Seconds of a forward pass over ``tokens`` tokens (2 x params FLOPs per token)."""
    return 2 * params * tokens / CPU_FORWARD_FLOPS


def activation_bytes(shape: Any, batch: int, seq: int) -> float:
    """One inference forward pass of ``batch`` x ``seq`` tokens in float32: one block's live tensors,
    its attention scores, and float32 logits + log-probabilities."""
    return block_bytes(shape, batch, seq, 4) + 2 * batch * seq * shape.text.vocab_size * 4


def training_bytes(shape: Any, batch: int, seq: int, bf16: bool) -> float:
    """Activations kept for backward, s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits (Korthikanti
    et al. 2022; x2 in float32), plus teacher and student logits, log-probabilities and their gradient."""
    t = shape.text
    per_layer = seq * batch * t.hidden_size * (34 + 5 * t.num_attention_heads * seq / t.hidden_size)
    return t.num_hidden_layers * per_layer * (1 if bf16 else 2) + 4 * batch * seq * t.vocab_size * 4
