"""Task accuracy through lm-evaluation-harness (compress/eval/tasks.py, compress/steps/tasks.py): question
files read and checked, the log-likelihood scorer against a plain forward, gates on a drop in points, and
a run that scores one task on the baseline, the compressed model and its GGUF and ONNX exports."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from compress.errors import DataError
from compress.eval.gates import evaluate_gates
from compress.eval.metrics import Evaluation, torch_forward
from compress.eval.tasks import Scorer, interval, load_task
from compress.paths import usable_cpus
from compress.recipe import recipe_model
from compress.schema.recipe import GateConfig, TaskConfig
from tests.helpers import recipe_text, run_cli, write_recipe


def _task(source: str, **kw: Any) -> TaskConfig:
    return TaskConfig(name="t", source=source, **kw)


def _questions(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` four-choice questions from the generated text's vocabulary, answers as letters, indices or text."""
    rng = random.Random(seed)
    words = ["river", "stone", "market", "winter", "silver", "garden", "letter", "bridge", "candle", "forest"]
    rows = []
    for i in range(n):
        choices = rng.sample(words, 4)
        right = rng.randrange(4)
        answer: Any = ["ABCD"[right], right, choices[right]][i % 3]
        rows.append(
            {
                "question": f"{i}. Which word follows the {rng.choice(words)} by the {rng.choice(words)}?",
                "choices": choices,
                "answer": answer,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_question_files_are_read_checked_and_sampled(tmp_path: Path) -> None:
    path = _questions(tmp_path / "q.jsonl", 30)
    data = load_task(_task(str(path), limit=10, seed=3, num_fewshot=2), tmp_path)
    assert len(data.docs) == 10 and len(data.fewshot) == 16 and data.rows == 30
    assert all(0 <= d["answer"] < 4 and len(d["choices"]) == 4 for d in data.docs)
    again = load_task(_task(str(path), limit=10, seed=3, num_fewshot=2), tmp_path)
    other = load_task(_task(str(path), limit=10, seed=4, num_fewshot=2), tmp_path)
    assert again.sha256 == data.sha256 and other.sha256 != data.sha256
    every = load_task(_task(str(path), limit=None, num_fewshot=3), tmp_path)  # all but the few-shot examples
    assert len(every.docs) == 27 and len(every.fewshot) == 3
    evaluated = {json.dumps(d, sort_keys=True) for d in data.docs}
    assert not evaluated & {json.dumps(d, sort_keys=True) for d in data.fewshot}  # few-shot examples are never evaluated
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    original = {r["question"]: r for r in rows}
    for doc in data.docs:  # a letter, an index or the choice's text: each resolves to its choice
        raw = original[doc["question"]]["answer"]
        expected = raw if isinstance(raw, int) else "ABCD".index(raw) if len(raw) == 1 else doc["choices"].index(raw)
        assert doc["answer"] == expected
    csv_file = tmp_path / "q.csv"
    csv_file.write_text('q,a,b,right\n"Two plus two?",four,five,A\n"Sky colour?",green,blue,1\n')
    mapped = load_task(_task(str(csv_file), question_field="q", choices_field=["a", "b"], answer_field="right", limit=None), tmp_path)
    assert [d["answer"] for d in mapped.docs] == [0, 1] and mapped.docs[0]["choices"] == ["four", "five"]


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ('{"question": "q", "choices": ["a", "b"]}\n', ".jsonl", "q.jsonl:1: no field 'answer'"),
        ('{"question": "q", "choices": ["a", "b"], "answer": "E"}\n', ".jsonl", "q.jsonl:1: field 'answer' points at choice 4"),
        ('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": "q"\n', ".jsonl", "q.jsonl:2: not a JSON object"),
        ('{"question": "q", "choices": "a", "answer": 0}\n', ".jsonl", "field 'choices' is text, not a list"),
        ('{"question": "", "choices": ["a", "b"], "answer": 0}\n', ".jsonl", "field 'question' is empty"),
        ('{"question": "q", "choices": ["a"], "answer": 0}\n', ".jsonl", "1 choices"),
        ('{"question": "q"}', ".json", "holds a list of question objects"),
        ("question,choices,answer\n", ".csv", "holds no questions"),
        ("x", ".txt", "a task file is .jsonl, .json or .csv"),
    ],
)
def test_bad_question_files_name_the_file_row_and_field(tmp_path: Path, content: str, suffix: str, message: str) -> None:
    path = tmp_path / f"q{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_task(_task(str(path)), tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_task(_task("missing.jsonl"), tmp_path)


def test_recipe_checks_tasks_and_their_gates(tiny_model_dir: Path, text_dir: Path) -> None:
    import yaml

    base = yaml.safe_load(recipe_text(tiny_model_dir, text_dir))
    base["tasks"] = [{"name": "quiz", "source": "q.jsonl"}]

    def check(gates: list[dict[str, Any]], tasks: list[dict[str, Any]] | None = None) -> str:
        try:
            recipe_model().model_validate({**base, "gates": gates, **({"tasks": tasks} if tasks is not None else {})})
        except ValueError as exc:
            return str(exc)
        return ""

    assert check([{"metric": "accuracy", "task": "quiz", "max_decrease": 2}]) == ""
    assert "name the task" in check([{"metric": "accuracy", "max_decrease": 2}])
    assert "not a task of this recipe" in check([{"metric": "accuracy", "task": "other", "max_decrease": 2}])
    assert "task applies to the task metrics" in check([{"metric": "perplexity", "task": "quiz", "max": 2}])
    assert "cannot gate the baseline itself" in check([{"metric": "accuracy", "task": "quiz", "artifact": "baseline", "max_decrease": 2}])
    assert "brings its own" in check([], [{"name": "m", "source": "reference:mmlu", "answer_field": "x"}])
    assert "applies to multiple_choice" in check([], [{"name": "m", "source": "q.jsonl", "kind": "loglikelihood", "choices_field": "c"}])
    assert "task names must be unique" in check([], [{"name": "m", "source": "a.jsonl"}, {"name": "m", "source": "b.jsonl"}])
    assert "not an artifact of this recipe" in check([], [{"name": "m", "source": "a.jsonl", "artifacts": ["gguf"]}])


def _task_eval(artifact: str, accuracy: float, stderr: float, task: str = "quiz") -> Evaluation:
    return Evaluation(
        artifact=artifact,
        runtime="torch",
        device="cpu",
        metrics={"accuracy": accuracy, "accuracy_stderr": stderr, "questions": 400},
        kind="task",
        details={"task": task},
        intervals={"accuracy": interval(accuracy, stderr, 400)},
    )


def test_a_gates_files_task_gates_name_its_tasks(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`compress gate` reads tasks from the gates file; a gate naming no task of it is exit 2 naming the
    gate, and gating a bare model folder on a task needs --baseline (the tokenizer and the baseline's score)."""
    questions = _questions(tmp_path / "quiz.jsonl", 8)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"version: 1\ntasks:\n  - {{name: quiz, source: {questions.name}}}\ngates:\n  - {{metric: accuracy, task: exam, min: 1}}\n"
    )
    result = run_cli(["gate", tiny_model_dir, "--gates", bad, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 2 and "gates[0].task 'exam' is not a task of the gates file; known: quiz" in result.output
    good = tmp_path / "good.yaml"
    good.write_text(
        f"version: 1\ntasks:\n  - {{name: quiz, source: {questions.name}}}\ngates:\n  - {{metric: accuracy, task: quiz, min: 0}}\n"
    )
    result = run_cli(["gate", tiny_model_dir, "--gates", good, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 2 and "task gates" in result.output and "--baseline" in result.output
    result = run_cli(["gate", tiny_model_dir, "--gates", good, "--baseline", tiny_model_dir, "-o", tmp_path / "r", "-q"])
    assert result.exit_code == 0, result.output
    (task,) = [e for e in json.loads((tmp_path / "r" / "report.json").read_text())["evaluations"] if e["kind"] == "task"]
    assert task["artifact"] == "compressed" and task["metrics"]["questions"] == 8 and task["runtime"] == "torch"


def test_gates_on_a_drop_in_points_and_on_the_interval() -> None:
    evals = [_task_eval("baseline", 40.0, 2.4), _task_eval("compressed", 37.5, 2.4), _task_eval("compressed", 90.0, 1.0, task="other")]
    drop2 = GateConfig(metric="accuracy", task="quiz", max_decrease=2)
    drop3 = GateConfig(metric="accuracy", task="quiz", max_decrease=3)
    floor = GateConfig(metric="accuracy", task="quiz", min=35, on="lower_95")
    other = GateConfig(metric="accuracy", task="other", min=80)
    missing = GateConfig(metric="accuracy_norm", task="quiz", min=10)
    results = evaluate_gates([drop2, drop3, floor, other, missing], evals)
    assert [r.passed for r in results] == [False, True, False, True, False]
    assert results[0].threshold["limit"] == pytest.approx(38.0) and results[0].threshold["baseline"] == 40.0
    assert results[2].value == pytest.approx(37.5 - 1.959964 * 2.4)
    assert results[3].value == 90.0  # the gate reads the task it names
    assert results[4].source == "missing" and "on task 'quiz'" in results[4].message


def test_scorer_matches_a_plain_forward(tiny_model_dir: Path) -> None:
    """Each log-likelihood equals the sum of the continuation's log-probabilities from one full forward;
    one-token continuations that share a context are answered by one pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def encode(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    scorer = Scorer(torch_forward(model, torch.device("cpu")), encode, tok.eos_token_id)
    context = "The river by the"
    single = [w for w in (" the", " and", " of", " a", " to", " in", " stone", " river") if len(scorer.split(context, w)[1]) == 1][:2]
    assert len(single) == 2, "the tiny tokenizer has fewer than two one-token words"
    pairs = [(context, single[0]), (context, single[1]), ("A letter", " from the silver market")]
    found = scorer.score(pairs)
    assert scorer.passes == 2  # the two one-token choices share a sequence
    for (ctx, cont), (logp, greedy) in zip(pairs, found, strict=True):
        c, x = scorer.split(ctx, cont)
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([c + x])).logits[0].float(), -1)
        picked = full[len(c) - 1 : len(c) - 1 + len(x)]
        assert logp == pytest.approx(float(picked.gather(-1, torch.tensor(x)[:, None]).sum()), abs=1e-4)
        assert greedy == bool((picked.argmax(-1) == torch.tensor(x)).all())
    short = Scorer(torch_forward(model, torch.device("cpu")), encode, tok.eos_token_id, max_length=4)
    clipped = short.score([("one two three four five six seven", " eight")])
    assert short.truncated == 1 and clipped[0][0] < 0


@pytest.mark.runtime
@pytest.mark.slow
def test_run_scores_a_task_on_every_runtime_and_gates_on_it(tmp_path: Path, onnx_model_dir: Path, text_dir: Path) -> None:
    questions = _questions(tmp_path / "quiz.jsonl", 40)
    gates = "  - {metric: accuracy, task: quiz, artifact: q4, max_decrease: 100}\n  - {metric: accuracy, task: quiz, min: 101}"
    text = recipe_text(onnx_model_dir, text_dir, bits=4, group_size=32, symmetric=False, gates=gates)
    text = text.replace("exports: []", "exports:\n  - format: gguf\n    name: q4\n  - format: onnx\n    name: int4")
    text += f"tasks:\n  - name: quiz\n    source: {questions.name}\n    limit: 24\n    num_fewshot: 1\n"
    recipe = write_recipe(tmp_path, text)
    result = run_cli(["run", recipe, "-o", tmp_path / "out"])
    assert result.exit_code == 1, result.output  # the min: 101 gate fails; the drop gate passes
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    tasks = {e["artifact"]: e for e in report["evaluations"] if e["kind"] == "task"}
    assert set(tasks) == {"baseline", "compressed", "q4", "int4"}
    assert {e["runtime"] for e in tasks.values()} == {"torch", "llama.cpp", "onnxruntime"}
    for e in tasks.values():
        m = e["metrics"]
        assert m["questions"] == 24 and 0 <= m["accuracy"] <= 100 and m["questions_per_s"] > 0
        assert e["intervals"]["accuracy"]["lower"] <= m["accuracy"] <= e["intervals"]["accuracy"]["upper"]
        assert e["details"]["task"] == "quiz" and e["build"]["runtime"] == e["runtime"]
    # The exports answer with the compressed model's weights on their runtimes: the same choices within the runtimes' rounding.
    assert abs(tasks["q4"]["metrics"]["accuracy"] - tasks["compressed"]["metrics"]["accuracy"]) <= 100 / 24 * 2
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["q4.quiz.accuracy.max_decrease"]["passed"]
    assert gates["q4.quiz.accuracy.max_decrease"]["threshold"]["baseline"] == tasks["baseline"]["metrics"]["accuracy"]
    assert not gates["compressed.quiz.accuracy.min"]["passed"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    (entry,) = manifest["data"]["tasks"]
    assert entry["questions"] == 24 and entry["rows"] == 40 and len(entry["sha256"]) == 64
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "### Tasks" in summary and "quiz" in summary
    # `compress gate` on the finished artifact scores the task itself (the gates file's own `tasks:`)
    gates_file = tmp_path / "gates.yaml"
    gates_file.write_text(
        f"version: 1\ntasks:\n  - name: quiz\n    source: {questions.name}\n    limit: 24\n    num_fewshot: 1\ngates:\n"
        "  - {metric: accuracy, task: quiz, artifact: q4, max_decrease: 100}\n  - {metric: accuracy, task: quiz, artifact: int4, min: 101}\n"
    )
    result = run_cli(["gate", tmp_path / "out", "--gates", gates_file, "-o", tmp_path / "gate-report", "-q"])
    assert result.exit_code == 1, result.output
    gated = json.loads((tmp_path / "gate-report" / "report.json").read_text())
    measured = {e["artifact"]: e for e in gated["evaluations"] if e["kind"] == "task"}
    assert set(measured) == {"baseline", "q4", "int4"} and measured["int4"]["runtime"] == "onnxruntime"
    assert measured["baseline"]["metrics"]["accuracy"] == tasks["baseline"]["metrics"]["accuracy"]  # the same questions, prompts and model
    assert abs(measured["q4"]["metrics"]["accuracy"] - tasks["q4"]["metrics"]["accuracy"]) <= 100 / 24
    results = {g["name"]: g["passed"] for g in gated["gates"]}
    assert results == {"q4.quiz.accuracy.max_decrease": True, "int4.quiz.accuracy.min": False}


@pytest.mark.real_model
@pytest.mark.runtime
@pytest.mark.slow
@pytest.mark.minutes(0.7)
def test_mmlu_on_the_reference_model_in_torch_and_in_llama_cpp(smollm2, tmp_path: Path) -> None:
    """reference:mmlu is read whole (14,042 questions, 57 subjects); 40 of them scored on the reference
    model in torch (float32 weights dequantized from its GGUF) and in llama.cpp (the GGUF itself):
    the same weights, so the two accuracies agree to within the runtimes' rounding; one pass a question."""
    from compress.eval.tasks import make_lm, run_task
    from compress.export.gguf.runtime import LlamaCppModel

    task = TaskConfig(name="mmlu", source="reference:mmlu", limit=40)
    data = load_task(task, tmp_path)
    assert data.rows == 14042 and len(data.docs) == 40 and all(len(d["choices"]) == 4 and d["subject"] for d in data.docs)
    tok = smollm2.tokenizer
    files = data.write(tmp_path / "data")

    def encode(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    on_torch = run_task(
        task, data, files, tmp_path / "cache", make_lm(torch_forward(smollm2.model, torch.device("cpu")), encode, tok.eos_token_id)
    )
    runtime = LlamaCppModel(Path(smollm2.source_path), n_ctx=2048, threads=usable_cpus())
    try:
        on_llama = run_task(task, data, files, tmp_path / "cache", make_lm(runtime.forward, encode, tok.eos_token_id))
    finally:
        runtime.close()
    assert on_torch.passes == 40 and on_llama.passes == 40  # the four lettered choices share one sequence
    assert on_torch.stderr is not None and 0 < on_torch.stderr < 10
    assert abs(on_torch.accuracy - on_llama.accuracy) <= 100 * 2 / 40, (on_torch, on_llama)
