"""The distillation training loop: micro-batches, losses, optimizer steps, held-apart evaluation,
checkpoints, and the processes of a multi-process run (see distill.py for the stage)."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compress.distill import checkpoint
from compress.distill.losses import CosineSchedule, hidden_loss, kl_loss, topk_kl_loss
from compress.eval.metrics import compare, torch_forward
from compress.progress import Reporter

if TYPE_CHECKING:
    from compress.distill.config import DistillConfig
    from compress.distill.teacher_store import TeacherLogits


def process_rank() -> tuple[int, int]:
    """(rank, world size) when started by ``accelerate launch`` / torchrun, else (0, 1)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


PLAN_AFTER = 3  # steps this process times before a time budget plans how many fit
REPLAN_EVERY = 10  # then every this many steps the plan is fitted again to the median of as many recent steps


def eval_min_context(seq_len: int) -> int:
    """Context before a scored token in the held-apart evaluation during training."""
    return min(32, seq_len // 4)


# --------------------------------------------------------------------------- processes


def end_processes() -> None:
    """After the last training stage of a run in several processes: wait for all of them, then take
    the process group down in each, so a secondary process that exits now (the main one goes on to
    evaluate and write alone) does not leave the collective library's threads to be killed at exit
    ("terminate called without an active exception", SIGABRT)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fsdp_requested() -> bool:
    """``accelerate launch --use_fsdp`` (or an accelerate config with ``distributed_type: FSDP``) asked for FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


class Processes:
    """The processes of this run: one, or several under ``accelerate launch`` (accelerate
    initializes the process group and wraps the student with DDP; with FSDP asked for, the student
    is sharded with torch's FSDP2 instead, see :meth:`wrap`)."""

    def __init__(self, device: torch.device) -> None:
        self.rank, self.world = process_rank()
        self.accelerator = None
        self.device = device
        if self.world > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=device.type == "cpu")
            self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.fsdp = self.world > 1 and fsdp_requested()

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def kind(self) -> str:
        return "one process" if self.world == 1 else "FSDP" if self.fsdp else "DDP"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The student as trained: itself (one process), DDP around it, or under FSDP a copy of it
        sharded over the processes — each decoder block its own FSDP2 unit, then the rest, with torch's
        ``fully_shard`` (what accelerate's FSDP2 does with transformer-based wrapping; accelerate 1.15
        itself turns FSDP off for processes on the CPU and runs DDP instead, silently). The copy
        leaves ``model`` whole for the main process to go on with (:meth:`gather`)."""
        if self.accelerator is None:
            return model
        if not self.fsdp:
            return self.accelerator.prepare_model(model)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from compress.quantizers.arch import architecture_of, decoder_blocks

        model.to("cpu")  # the whole student waits in host memory; fully_shard moves each process's shard to the mesh's device
        sharded = copy.deepcopy(model)
        mesh = init_device_mesh(self.device.type, (self.world,))
        for block in decoder_blocks(sharded, architecture_of(sharded)):
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        return sharded

    def gather(self, wrapped: nn.Module, model: nn.Module) -> None:
        """After training, the trained weights whole in ``model`` in every process (FSDP: gathered
        from the shards; DDP and one process train ``model``'s own parameters)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
            model.load_state_dict(full)

    def adopt(
        self, model: nn.Module, sharded: nn.Module, optimizer: torch.optim.Optimizer, trainable: list[nn.Parameter]
    ) -> list[nn.Parameter]:
        """FSDP: the optimizer moved onto the sharded copy's parameters of the same names, any state
        it holds (a resumed run's, whole) sharded like them, as accelerate's FSDP2 preparation moves an
        optimizer; returns the trainable parameters of the copy."""
        from torch.distributed.tensor import distribute_tensor

        name_of = {id(p): n for n, p in model.named_parameters()}
        params = dict(sharded.named_parameters())
        moved = {id(p): params[name_of[id(p)]] for p in trainable}
        for group in optimizer.param_groups:
            group["params"] = [moved[id(p)] for p in group["params"]]
        state = {}
        for p, entry in optimizer.state.items():
            q = moved[id(p)]
            state[q] = {
                k: distribute_tensor(v.to(q.device), q.device_mesh, q.placements) if torch.is_tensor(v) and v.shape == q.shape else v
                for k, v in entry.items()
            }
        optimizer.state.clear()
        optimizer.state.update(state)
        return [moved[id(p)] for p in trainable]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with whole tensors (FSDP: gathered; every process must call)."""
        sd = optimizer.state_dict()
        if self.fsdp:
            sd["state"] = {i: {k: self.whole(v) for k, v in entry.items()} for i, entry in sd["state"].items()}
        return sd

    def like(self, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """``value`` (whole) laid out like ``param``: sharded the same way for an FSDP parameter."""
        if not hasattr(param, "device_mesh"):
            return value
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)

    @contextlib.contextmanager
    def whole_root(self, module: nn.Module) -> Iterator[None]:
        """The sharded root's own parameters (embeddings, final norm, head) gathered while the body is
        inside: the evaluation calls the base model and the head apart, not the root's forward, which
        would gather them (the blocks gather their own)."""
        if not self.fsdp or module is None or not hasattr(module, "unshard"):
            yield
            return
        module.unshard()
        try:
            yield
        finally:
            module.reshard()

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """A parameter's full value: gathered from every process for an FSDP shard (every process must call)."""
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def no_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if self.accelerator is None or sync or self.fsdp:  # FSDP reduces every micro-batch's gradients: slower, the same sums
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def mean(self, value: float) -> float:
        if self.accelerator is None:
            return value
        return float(self.accelerator.reduce(torch.tensor([value], device=self.accelerator.device), reduction="mean")[0])

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def agree(self, value: int) -> int:
        """The main process's ``value`` in every process (decisions taken on timings, which differ)."""
        if self.accelerator is None:
            return value
        from accelerate.utils import broadcast

        return int(broadcast(torch.tensor([value], device=self.accelerator.device), from_process=0)[0])


@dataclass
class Trainer:
    """One distillation run from ``state.step`` to ``state.planned_steps``: ``config.steps``, or
    under ``config.max_minutes`` the steps that fit the budget (planned after PLAN_AFTER timed
    steps from the median step time and the measured evaluation time, fitted again every
    REPLAN_EVERY steps; a step that would end past the budget is not started)."""

    config: DistillConfig
    label: str
    model: nn.Module  # the student itself
    teacher: nn.Module
    procs: Processes
    optimizer: torch.optim.Optimizer
    scheduler: Any
    schedule: CosineSchedule
    trainable: list[nn.Parameter]
    state: checkpoint.TrainState
    train_tokens: torch.Tensor
    eval_tokens: torch.Tensor
    device: torch.device
    bf16: bool
    pairs: list[tuple[int, int]]
    channels: torch.Tensor | None
    checkpoint_dir: Path | None
    fingerprint: str
    reporter: Reporter
    refit: Callable[[], dict[str, Any]] | None = None  # the closed-form first phase (distill/refit.py), before step 1
    stored: TeacherLogits | None = None  # the teacher's stored top-k log-probs, read instead of running the teacher
    wrapped: nn.Module = field(init=False)  # the student as trained (DDP/FSDP wrapper in a multi-process run), set by run()

    @property
    def tokens_per_step(self) -> int:
        return self.config.tokens_per_step(self.procs.world)

    def batches(self, step: int) -> Iterator[torch.Tensor]:
        """This process's micro-batches of optimizer step ``step``: a fixed function of the step,
        so a resumed run and a run with more processes see the same chunks."""
        c, n = self.config, self.train_tokens.shape[0]
        for micro in range(c.grad_accum):
            first = ((step * c.grad_accum + micro) * self.procs.world + self.procs.rank) * c.batch_size
            rows = [sample_order(n, c.data.seed, (first + k) // n)[(first + k) % n] for k in range(c.batch_size)]
            yield self.train_tokens[rows]

    @property
    def live(self) -> nn.Module:
        """The module holding the current weights: the sharded copy under FSDP once training began, else the student."""
        wrapped = getattr(self, "wrapped", None)
        return wrapped if wrapped is not None and self.procs.fsdp else self.model

    def evaluate(self) -> dict[str, Any]:
        live = self.live
        live.eval()
        with self.procs.whole_root(live if live is not self.model else None):
            metrics = compare(
                torch_forward(self.teacher, self.device),
                {"student": torch_forward(live, self.device)},
                self.eval_tokens,
                min_context=eval_min_context(self.config.seq_len),
            )["student"]
        live.train()
        s = self.state
        return {
            "step": s.step,
            "tokens": s.tokens,
            "seconds": round(s.seconds, 2),
            **{k: metrics[k] for k in ("kl_divergence", "top1_agreement", "perplexity")},
        }

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.loss == "ce":  # fine-tuning on the text: each position predicts the next token
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                s_out = self.wrapped(input_ids=ids, use_cache=False)
            logits = s_out.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        if self.stored is not None:
            values, indices, rest = self.stored(ids)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                s_out = self.wrapped(input_ids=ids, use_cache=False)
            return topk_kl_loss(s_out.logits, values, indices, rest, c.temperature)
        hidden = bool(self.pairs)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            with torch.no_grad():
                t_out = self.teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden)
            s_out = self.wrapped(input_ids=ids, use_cache=False, output_hidden_states=hidden)
        loss = kl_loss(s_out.logits, t_out.logits, c.temperature)
        if hidden:
            loss = loss + c.hidden_loss_weight * hidden_loss(s_out.hidden_states, t_out.hidden_states, self.pairs, self.channels)
        return loss

    def step(self) -> tuple[float, float | None]:
        """One optimizer step; returns (mean loss over processes, gradient norm before clipping)."""
        c = self.config
        loss_sum = 0.0
        for micro, ids in enumerate(self.batches(self.state.step)):
            with self.procs.no_sync(self.wrapped, micro == c.grad_accum - 1):
                loss = self.loss(ids.to(self.device))
                (loss / c.grad_accum).backward()
            loss_sum += float(loss.detach())
        grad_norm = None
        if c.max_grad_norm is not None:
            grad_norm = float(self.procs.whole(torch.nn.utils.clip_grad_norm_(self.trainable, c.max_grad_norm)))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.procs.mean(loss_sum / c.grad_accum), grad_norm

    def run(self) -> None:
        c, state = self.config, self.state
        state.planned_steps = state.planned_steps or c.step_cap(self.procs.world)
        self.schedule.total = state.planned_steps
        began = time.perf_counter() - state.wall_seconds
        if not state.history:
            state.history.append({**self.evaluate(), "loss": None})
            state.eval_seconds = time.perf_counter() - began
            if self.refit is not None:  # its time counts in the budget; a resumed run has it in its checkpoint
                done = self.refit()
                point = {**self.evaluate(), "loss": None, "refit": done}
                state.history.append(point)
                self.reporter.info(
                    f"{self.label} least-squares refit of {len(done['blocks'])} down projections "
                    f"({done['tokens']:,} tokens, {done['seconds']:.0f} s): KL {point['kl_divergence']:.4f}  "
                    f"top-1 {point['top1_agreement']:.2%}  ppl {point['perplexity']:.2f}"
                )
        self.wrapped = self.procs.wrap(self.model)  # after the refit: it writes the plain modules' weights
        if self.procs.fsdp:
            self.trainable = self.procs.adopt(self.model, self.wrapped, self.optimizer, self.trainable)
        if state.step == 0 and state.best is None:
            self.consider(last=False)  # the weights training starts from
        self.live.train()
        timed: list[float] = []
        with self.reporter.bar(f"{self.label} distill", total=state.planned_steps, completed=state.step) as advance:
            while state.step < state.planned_steps:
                tick = time.perf_counter()
                loss, grad_norm = self.step()
                seconds = time.perf_counter() - tick
                state.step += 1
                state.tokens += self.tokens_per_step
                state.seconds += seconds
                timed.append(seconds)
                state.wall_seconds = time.perf_counter() - began
                replanned = self.replan(timed)
                advance(f"loss {loss:.4f}  {self.tokens_per_step / seconds:,.0f} tok/s", total=replanned)
                last = state.step == state.planned_steps
                if (c.eval.every and state.step % c.eval.every == 0) or last:
                    point = {**self.evaluate(), "loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm}
                    state.history.append(point)
                    self.reporter.info(
                        f"{self.label} step {state.step}: KL {point['kl_divergence']:.4f}  "
                        f"top-1 {point['top1_agreement']:.2%}  ppl {point['perplexity']:.2f}  loss {loss:.4f}"
                    )
                    self.consider(last)
                state.wall_seconds = time.perf_counter() - began
                if self.checkpoint_dir is not None and c.checkpoint_every and state.step % c.checkpoint_every == 0 and not last:
                    optimizer_state = self.procs.optimizer_state(self.optimizer)  # whole tensors, as one process writes them
                    self.procs.gather(self.wrapped, self.model)
                    if self.procs.main:
                        checkpoint.save(self.checkpoint_dir, self.model, optimizer_state, self.scheduler, state, self.fingerprint)
                    self.procs.barrier()
                    state.wall_seconds = time.perf_counter() - began
        self.restore_best()

    def consider(self, last: bool) -> None:
        """``keep_best``: if the newest held-apart evaluation is the lowest KL so far, remember it, with
        a CPU copy of the trainable tensors unless they are the last step's (the main process decides)."""
        state = self.state
        if not self.config.keep_best:
            return
        newest = len(state.history) - 1
        better = state.best is None or state.history[newest]["kl_divergence"] < state.history[state.best]["kl_divergence"]
        if not self.procs.agree(int(better)):
            return
        state.best = newest
        state.best_weights = None if last else [self.procs.whole(p.detach()).to("cpu", copy=True) for p in self.trainable]

    def restore_best(self) -> None:
        """Put back the remembered weights when an earlier evaluation beat the last one."""
        if self.state.best_weights is None:
            return
        with torch.no_grad():
            for p, saved in zip(self.trainable, self.state.best_weights, strict=True):
                p.copy_(self.procs.like(saved, p))
        self.state.best_weights = None

    def replan(self, timed: list[float]) -> int | None:
        """Under ``max_minutes``: after PLAN_AFTER timed steps, set ``planned_steps`` to the steps that
        fit (and the cosine decay's end with it), and again every REPLAN_EVERY steps from the median
        of the last REPLAN_EVERY (the first steps can run slower than the rest; a plan kept from
        them left two minutes of a 14.5-minute budget unused); at any step, end there when this step's
        evaluation, one more step and the final evaluation would pass the budget. Returns the new
        end when it changed."""
        c, state = self.config, self.state
        if c.max_minutes is None:
            return None
        step_s = statistics.median(timed[-PLAN_AFTER:])
        left = c.max_minutes * 60 - state.wall_seconds - state.eval_seconds  # the final evaluation always runs
        evaluates_now = bool(c.eval.every) and state.step % c.eval.every == 0
        if left < step_s + (state.eval_seconds if evaluates_now else 0.0):
            planned = state.step
        elif len(timed) == PLAN_AFTER or (len(timed) > PLAN_AFTER and len(timed) % REPLAN_EVERY == 0):
            recent = statistics.median(timed[-REPLAN_EVERY:])  # at the first plan: the PLAN_AFTER steps timed
            per_step = recent + (state.eval_seconds / c.eval.every if c.eval.every else 0.0)
            planned = min(c.step_cap(self.procs.world), state.step + max(0, int(left // per_step)))
        else:
            planned = state.planned_steps
        planned = self.procs.agree(planned)
        if planned == state.planned_steps:
            return None
        state.planned_steps = self.schedule.total = planned
        return planned


@functools.lru_cache(maxsize=4)
def sample_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The order of the training chunks in ``epoch`` (a fresh permutation each epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n, generator=g).tolist())
