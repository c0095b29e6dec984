"""The types of the plugin objects in compress.plugins: what a quantization method and a
stage kind must say about themselves. Torch-free: a plugin object names its stage class through a loader
that imports it when a run builds the stage, so reading the tables (``compress validate``,
``compress plan``) never imports torch through them.

Kept apart from compress.plugins so that a plugin module (quantizers/plugin.py, pruning/plugin.py, ...)
can import these types while compress.plugins imports the plugin objects.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compress.context import Stage
    from compress.eval.plan.estimates import Estimate, PlanStep


@dataclass(frozen=True)
class QuantMethod:
    """One weight-quantization method: the value of ``quantize: {method: ...}`` in a recipe."""

    name: str
    """The recipe's ``method`` value (the table key)."""
    config: type
    """Its config model (torch-free, beside the method's code): a ``compress.schema.quantize.WeightQuantConfig`` subclass with
    ``method: Literal[name]``, validated at construction (fields documented with ``Field``)."""
    load_stage: Callable[[], type]
    """Imports and returns the Stage class, ``cls(config, label)`` with ``apply(model, ctx) ->
    StageRecord``; called only when a run builds its stages (torch is imported there)."""
    estimate: Callable[[PlanStep, dict[str, Any]], Estimate]
    """`compress plan`'s peak memory and time of this method on ``step``, given the plan records
    (name -> ``Record``) of the layers the stage quantizes."""
    cost: int
    """Search order among candidates of equal expected size: a cheaper method runs first."""
    description: str
    """One line for people: what the method does (docs, `--help`, error messages)."""
    not_carried: str | None = None
    """What no export format holds of this method (said on every export of a run that used it),
    or None when the QuantizedWeight records carry all of it."""
    load_records_only: Callable[[], Callable[[Any], AbstractContextManager[None]]] | None = None
    """With ``not_carried``: imports and returns ``records_only(model)``, a context in which the model
    computes with its records alone (what the exports hold), the reference of the exports'
    same-weights checks. Called only when a run exports such a model."""
    streams: bool | Callable[[Any], bool] = False
    """True: the stage reads and changes the model one streamed unit (decoder block, head) at a time
    (compress/streaming.py); False: the run reads the whole model into memory before the stage; or a
    function of the stage's config saying which (a method with a backend that needs the whole model)."""

    def build(self, config: Any, label: str) -> Stage:
        """The stage that runs ``config`` at recipe place ``label`` (``stages[0]``)."""
        return self.load_stage()(config, label)


@dataclass(frozen=True)
class StageKind:
    """One stage kind: the single key of a recipe's ``stages:`` item (``quantize:``, ``prune:``, ...)."""

    name: str
    """The recipe key (the table key; also the stage item's key: compress.recipe.stage_model)."""
    config: type
    """Its config model (torch-free, in the kind's package); for ``quantize`` (``quantizes_weights``) the
    base ``WeightQuantConfig``: the recipe's ``quantize:`` is one of the QUANT_METHODS' configs, chosen
    by ``method`` (compress.recipe.recipe_model builds that union from the table)."""
    build: Callable[[Any, str], Stage]
    """``build(config, label)``: the Stage that runs it (imports torch and the implementation lazily)."""
    estimate: Callable[[PlanStep], Estimate]
    """`compress plan`'s peak memory and time of the stage."""
    summary: Callable[[dict[str, Any], dict[str, Any]], str]
    """One console line after `compress run`: from the manifest's stage entry (label, method,
    duration_s, summary) and the report."""
    description: str
    """One line for people: what the stage does."""
    streams: bool | Callable[[Any], bool] = False
    """True: the stage works on a streamed model one unit at a time (for ``quantize``: when its
    method streams); False: the run reads the whole model into memory before the stage; or a
    function of the stage's config saying which (prune: unless it cuts embedding channels)."""
    quantizes_weights: bool = False
    """True: the config is a ``WeightQuantConfig`` (``targets``, ``ignore``, ``scheme()``,
    ``method``: a key of QUANT_METHODS) and the stage leaves a QuantizedWeight record for every
    Linear layer it selects (plan sizes, group-size checks, search order read this)."""
    quantizes_kv_cache: bool = False
    """True: the stage sets the run's KV-cache scheme (``describe()``, ``evaluate``): the plan
    adds the ``kv_cache`` artifact when the config evaluates through the cache."""
    plan_shape: Callable[[Any, Any], Any] | None = None
    """``plan_shape(shape, config)``: the model shape the stage leaves, for a stage that changes
    the architecture (prune); None: the shape is unchanged."""
    trains: bool = False
    """True: the stage trains, in every process of an ``accelerate launch`` run."""
    keeps_checkpoints: bool = False
    """True: the stage keeps resumable checkpoints under the run's work directory, in a folder
    named by its label; they are removed once the artifact is written."""
