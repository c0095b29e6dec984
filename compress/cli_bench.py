"""`compress bench ...`: benchmarks measured as ratios against a baseline in the same run (compress/eval/bench/).

The options every benchmark shares (output directory and --overwrite, model, calibration and evaluation
text, threads) are declared once, in :data:`DATA_OPTIONS` and :func:`bench_command`, and reach each
command as one :class:`BenchOptions`; a command declares only its own options and the defaults it changes.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import typer

from compress.cli_options import OVERWRITE_OPTION, SET_OPTION, THREADS, threads_option
from compress.console import err, guarded, out
from compress.errors import CompressError
from compress.schema.recipe import MAX_LATENCY_BATCH, MAX_LATENCY_TOKENS

bench_app = typer.Typer(help="Benchmarks measured as ratios against a baseline in the same run.", no_args_is_help=True)


@dataclass(frozen=True)
class BenchOptions:
    """The options the `compress bench` commands share; a field is None where a command does not take it."""

    output: Path
    overwrite: bool
    threads: int
    model: str | None = None
    calibration: str | None = None
    cal_samples: int | None = None
    cal_seq_len: int | None = None
    evaluation: str | None = None
    eval_samples: int | None = None
    eval_seq_len: int | None = None
    decode_tokens: int | None = None
    repeats: int | None = None

    def data(self) -> Any:
        """The calibration and evaluation text as a recipe's `data:` block."""
        from compress.schema.recipe import DataConfig

        return DataConfig(
            calibration={"source": self.calibration, "samples": self.cal_samples, "seq_len": self.cal_seq_len},
            evaluation={"source": self.evaluation, "samples": self.eval_samples, "seq_len": self.eval_seq_len},
        )

    def claim(self) -> None:
        """The benchmark's directory, before any work: new, empty, or (with --overwrite) a benchmark's of ours, started afresh."""
        from compress.fsutil import claim_directory
        from compress.marker import BENCH

        claim_directory(self.output, BENCH, self.overwrite)

    def results(self, table: str) -> None:
        """Print the benchmark's Markdown table and where its files are."""
        out.print(table)
        out.print(f"results: {self.output / 'results.json'}, {self.output / 'results.md'}")


# The shared options besides output, overwrite and threads: (default, help) of each; a command may
# change either with bench_command's `changed`.
SHARED_OPTIONS: dict[str, tuple[Any, str]] = {
    "model": ("reference:smollm2-135m", "Model source (as in a recipe)."),
    "calibration": ("reference:shakespeare", "Calibration text source."),
    "cal_samples": (128, "Calibration chunks."),
    "cal_seq_len": (512, "Tokens per calibration chunk."),
    "evaluation": ("reference:shakespeare", "Evaluation text (kept apart from calibration text)."),
    "eval_samples": (32, "Evaluation chunks."),
    "eval_seq_len": (512, "Tokens per evaluation chunk."),
    "decode_tokens": (64, "Tokens generated per decode-speed repeat."),
    "repeats": (3, "Decode-speed repeats (the median is reported)."),
}
DATA = ("model", "calibration", "cal_samples", "cal_seq_len", "evaluation", "eval_samples", "eval_seq_len")
DECODE = ("decode_tokens", "repeats")
# Each option's type for typer: BenchOptions' field types, `X | None` read as X.
_TYPES = {k: (typing.get_args(t) or (t,))[0] for k, t in typing.get_type_hints(BenchOptions).items()}


def bench_command(
    name: str, threads_help: str, options: tuple[str, ...] = DATA, **changed: tuple[Any, str]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(opts: BenchOptions, ...its own options)`` as `compress bench NAME`, with the shared
    options (-o/--output defaulting to bench-NAME, --overwrite, ``options`` of SHARED_OPTIONS, --threads) in
    front of its own; ``changed``: another (default, help) for one of ``options``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        shared: dict[str, Any] = {
            "output": typer.Option(
                Path(f"bench-{name}"), "-o", "--output", help="Directory for results.json and results.md (a new one, or --overwrite)."
            ),
            "overwrite": OVERWRITE_OPTION,
        }
        for field in options:
            default, help_text = changed.get(field, SHARED_OPTIONS[field])
            shared[field] = typer.Option(default, help=help_text)
        shared["threads"] = threads_option(THREADS, threads_help)
        hints = typing.get_type_hints(fn)
        own = list(inspect.signature(fn).parameters.values())[1:]  # after opts
        own = [p.replace(annotation=hints[p.name]) for p in own]
        arguments = [p for p in own if isinstance(p.default, typer.models.ArgumentInfo)]
        rest = [p for p in own if p not in arguments]
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter(k, kind, default=o, annotation=_TYPES[k]) for k, o in shared.items()]

        def command(**kwargs: Any) -> Any:
            opts = BenchOptions(**{k: kwargs.pop(k) for k in shared})
            return fn(opts, **kwargs)

        command.__signature__ = inspect.Signature([*arguments, *params, *rest])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}  # type: ignore[attr-defined]
        command.__name__, command.__qualname__, command.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        bench_app.command(name)(guarded(command))
        return fn

    return register


def _candidates(parse: Callable[[str], Any], text: str) -> list[Any]:
    """Comma-separated candidates, each parsed; a bad one is an input error (exit 2)."""
    try:
        return [parse(c) for c in text.split(",") if c.strip()]
    except ValueError as exc:
        raise CompressError(str(exc)) from None


def _run_candidates(
    opts: BenchOptions, candidates: list[Any], run: Callable[..., dict[str, Any]], table: Callable[[dict[str, Any]], str], **own: Any
) -> None:
    """What `bench gguf` and `bench onnx` do once their own options are checked: claim the output directory,
    run the bench (``run``: run_gguf_bench or run_onnx_bench) on the shared data and decode options and the
    command's ``own`` arguments, and print its table."""
    from compress.progress import Reporter

    data = opts.data()
    opts.claim()
    result = run(
        opts.model,
        data,
        candidates,
        opts.output,
        opts.threads,
        reporter=Reporter(err),
        decode_tokens=opts.decode_tokens,
        repeats=opts.repeats,
        **own,
    )
    opts.results(table(result))


@bench_command("quant", "torch CPU threads.")
def bench_quant(
    opts: BenchOptions,
    methods: str = typer.Option("rtn,gptq,awq", help="Comma-separated methods."),
    settings: str = typer.Option("W4g128s,W4g128a,W3g128s,W3g128a", help="Comma-separated: W<bits>g<group><s|a>, or W<bits>pc<s|a>."),
    option: list[str] | None = typer.Option(
        None,
        "--option",
        help="METHOD.KEY=VALUE (YAML value), a method option other than the setting's; repeatable, e.g. awq.duo_scaling=true.",
    ),
    backends: str = typer.Option(
        "compress",
        help="Comma-separated implementations of gptq and awq, each scored as a row of its own: compress, llmcompressor.",
    ),
) -> None:
    """Compare RTN, GPTQ and AWQ (and their implementations): KL divergence, top-1 agreement, perplexity, time and memory."""
    import yaml
    from pydantic import ValidationError

    from compress.eval.bench.quant import Setting, backend_choices, markdown_table, run_quant_bench
    from compress.plugins import QUANT_METHODS
    from compress.progress import Reporter

    try:
        parsed = [Setting.parse(s) for s in settings.split(",") if s.strip()]
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in QUANT_METHODS]
    if unknown:
        raise CompressError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(QUANT_METHODS)}")
    method_options: dict[str, dict[str, Any]] = {}
    for text in option or []:
        key, eq, value = text.partition("=")
        method, dot, name = key.strip().partition(".")
        if not eq or not dot or not name or method not in QUANT_METHODS:
            raise CompressError(f"--option '{text}': expected METHOD.KEY=VALUE with METHOD one of {', '.join(QUANT_METHODS)}")
        if name in ("method", "bits", "group_size", "symmetric"):
            raise CompressError(f"--option '{text}': {name} comes from --settings")
        method_options.setdefault(method, {})[name] = yaml.safe_load(value)
    for method, method_opts in method_options.items():
        try:
            QUANT_METHODS[method].config(method=method, bits=4, **method_opts)
        except ValidationError as exc:
            raise CompressError(f"--option for {method}: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    chosen_backends = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen_backends or any(b not in backend_choices() for b in chosen_backends):
        raise CompressError(f"--backends '{backends}': expected a comma-separated list of {', '.join(backend_choices())}")
    if any(method_opts.get("backend") for method_opts in method_options.values()):
        raise CompressError("--option METHOD.backend: choose implementations with --backends (each one becomes a row)")
    data = opts.data()
    opts.claim()
    result = run_quant_bench(opts.model, data, chosen, parsed, opts.output, opts.threads, Reporter(err), method_options, chosen_backends)
    opts.results(markdown_table(result))


GGUF_CANDIDATES = (
    "gptq:W4g32s",
    "gptq:W4g128s",
    "gptq:W4g32a",
    "gptq:W4g128a",
    "awq:W4g32a",
    "awq:W4g128a",
    "llama.cpp:q4_0",
    "llama.cpp:q4_1",
    "llama.cpp:q4_k_m",
)  # compress bench gguf --candidates default


@bench_command("gguf", "torch and llama.cpp CPU threads.", DATA + DECODE)
def bench_gguf(
    opts: BenchOptions,
    candidates: str = typer.Option(
        ",".join(GGUF_CANDIDATES),
        help="Comma-separated: METHOD:SETTING (ours, e.g. gptq:W4g32s -> Q4_0, "
        "awq:W4g128a -> Q4_1), METHOD:TYPE (ours on llama.cpp's grid of that type, e.g. gptq:Q4_K, rtn:Q6_K), "
        "METHOD:mix@BITS or METHOD:mix@TYPE (ours, a type per layer under a size budget: bits per weight, or the size of "
        "llama.cpp's own file of that type, e.g. gptq:mix@Q4_K_M), llama.cpp:TYPE (its quantizer on our F16 file, mixes such "
        "as Q4_K_M), llama.cpp-imatrix:TYPE (the same with llama-imatrix's matrix of the calibration text; needs "
        "scripts/build_llama_tools.py) or llama.cpp-pure:TYPE (every tensor in that one type). After one of ours, +head "
        "quantizes the output head too, +head:TYPE by a second stage on that type's grid (gptq:W4g32s+head:Q8_0).",
    ),
    embedding_type: str = typer.Option(
        "q8_0",
        help="Token-embedding type of every candidate (ours and llama.cpp's): f16 | q8_0 | q4_k | ...; auto: each one's own "
        "(llama.cpp's rule, our float_type default, a budget's choice)",
    ),
    keep_files: bool = typer.Option(False, help="Keep the GGUF files under OUTPUT/files."),
    same_mix: bool = typer.Option(
        True, help="After each mix of ours, llama.cpp's quantizer on the same tensor types (its decode speed is the reference)."
    ),
    dtype: str = typer.Option(
        "auto",
        help="Compute dtype of the model, as a recipe's model.dtype: auto | float32 | bfloat16 | float16 (float32 on a CPU "
        "without bfloat16 instructions, where bfloat16 is many times slower: scripts/bf16_matmul.py).",
    ),
) -> None:
    """Our exact GGUFs (GPTQ/AWQ/RTN records, one type or a mix under a size budget) against llama.cpp's own quantizations, measured in llama.cpp."""
    from typing import get_args

    from compress.eval.bench.gguf import Candidate, markdown_table, run_gguf_bench
    from compress.schema.recipe import ModelConfig

    dtypes = get_args(ModelConfig.model_fields["dtype"].annotation)  # the recipe's model.dtype values, kept in one place
    if dtype not in dtypes:
        raise CompressError(f"--dtype: expected one of {', '.join(dtypes)}; got {dtype!r}")
    parsed = _candidates(Candidate.parse, candidates)
    _run_candidates(
        opts, parsed, run_gguf_bench, markdown_table, embedding_type=embedding_type, keep_files=keep_files, same_mix=same_mix, dtype=dtype
    )


ONNX_CANDIDATES = ("gptq:W4g32s+head", "builder:W4g32s", "gptq:W4g32a+head", "builder:W4g32a")


@bench_command("onnx", "torch and ONNX Runtime CPU threads.", DATA + DECODE)
def bench_onnx(
    opts: BenchOptions,
    candidates: str = typer.Option(
        ",".join(ONNX_CANDIDATES),
        help="Comma-separated: METHOD:SETTING (ours, exact MatMulNBits, e.g. gptq:W4g32a; +head: the output head through "
        "the method too, else rounded at export) or builder:SETTING (onnxruntime-genai's own quantizer at that block size).",
    ),
    accuracy_level: int = typer.Option(4, min=0, max=4, help="MatMulNBits accuracy_level of every int4 file (4: int8 activations)."),
    keep_files: bool = typer.Option(False, help="Keep the ONNX files under OUTPUT/files."),
    keep_float: str = typer.Option(
        "",
        help="Comma-separated tables every file keeps float (lm_head, embeddings); default none: the builder's int4 layout.",
    ),
) -> None:
    """Our exact GPTQ/AWQ int4 ONNX against onnxruntime-genai's own int4 at the same block size, measured in ONNX Runtime."""
    from compress.eval.bench.onnx import Candidate, markdown_table, run_onnx_bench

    parsed = _candidates(Candidate.parse, candidates)
    tables = [t.strip() for t in keep_float.split(",") if t.strip()]
    unknown = [t for t in tables if t not in ("lm_head", "embeddings")]
    if unknown:
        raise CompressError(f"--keep-float: {', '.join(unknown)}: expected lm_head or embeddings")
    _run_candidates(
        opts, parsed, run_onnx_bench, markdown_table, accuracy_level=accuracy_level, keep_files=keep_files, keep_float=tables or None
    )


@bench_command(
    "prune",
    "torch CPU threads.",
    calibration=("reference:shakespeare", "Calibration text: importance scores and the repair's training text."),
    cal_samples=(32, "Calibration chunks for the importance pass."),
    eval_samples=(16, "Evaluation chunks (of each text)."),
)
def bench_prune(
    opts: BenchOptions,
    unseen: list[str] | None = typer.Option(
        None,
        "--unseen",
        help="Another evaluation text, of a kind the repair does not train on; repeatable; default: reference:python-docs ('' for none).",
    ),
    setting: list[str] | None = typer.Option(
        None, "--setting", help="A prune: mapping in YAML, repeatable; default: '{mlp: 0.25}' and '{layers: {drop: 4}}'."
    ),
    distill: str = typer.Option(
        "{}",
        help="distill: options in YAML over the bench defaults (recipes/prune-distill.yaml's: 14.5 minutes, at most "
        "400 steps of 2 x 512 tokens, lr 3e-4, bf16), trained on --calibration text unless data.source says otherwise.",
    ),
    repair: list[str] | None = typer.Option(
        None,
        "--repair",
        help="A repair to run from the same pruned model: distill: options in YAML over --distill's, repeatable, e.g. "
        "'{}' (distillation), '{loss: ce}' (fine-tuning on the text), '{stored_teacher: {top_k: 64}}'. Each one's "
        "held-apart KL at every evaluation (set eval.every in --distill) is tabulated against training tokens and "
        "plotted (repair-curves.png). Default: one, --distill itself.",
    ),
    device: str = typer.Option("cpu", help="Where pruning, repair and scoring compute: cpu, cuda or auto (as compute.device in a recipe)."),
) -> None:
    """Prune, then repair by distillation (or several repairs): KL, top-1 and perplexity before/after, repair time and tokens."""
    import yaml
    from pydantic import ValidationError

    from compress.distill.config import DistillConfig
    from compress.eval.bench.prune import DEFAULT_DISTILL, DEFAULT_SETTINGS, markdown_table, run_prune_bench
    from compress.progress import Reporter
    from compress.pruning.config import PruneConfig
    from compress.steps.load import resolve_device

    def parse(kind: Any, text: str, base: dict[str, Any]) -> Any:
        try:
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise CompressError(f"'{text}' is not a YAML mapping")
            return kind.model_validate({**base, **value})
        except (yaml.YAMLError, ValidationError) as exc:
            raise CompressError(f"'{text}': {exc}") from None

    settings = [parse(PruneConfig, t, {}) for t in (setting or DEFAULT_SETTINGS)]
    config = parse(DistillConfig, distill, DEFAULT_DISTILL)
    base = config.model_dump(exclude_unset=True)
    repairs = []
    for text in repair or []:
        checked = parse(DistillConfig, text, base)  # a bad mapping or key: exit 2, naming it
        repairs.append((yaml.safe_load(text), checked))
    data = opts.data()
    sources = ["reference:python-docs"] if unseen is None else [u for u in unseen if u]
    if device not in ("cpu", "cuda", "auto"):
        raise CompressError(f"--device '{device}': expected cpu, cuda or auto")
    compute = resolve_device(device, "--device")
    opts.claim()
    result = run_prune_bench(
        opts.model, data, sources, settings, config, opts.output, opts.threads, Reporter(err), repairs or None, compute
    )
    opts.results(markdown_table(result))


@bench_command(
    "kv",
    "torch CPU threads.",
    ("model", "calibration", "cal_samples", "cal_seq_len", "evaluation", *DECODE),  # evaluation: --samples of --context tokens
    cal_samples=(16, "Calibration chunks (static-scale and fastgen schemes only)."),
    decode_tokens=(32, "Tokens per decode-speed repeat."),
)
def bench_kv(
    opts: BenchOptions,
    schemes: str = typer.Option(
        ",".join(("int8", "int4", "int2", "fp8")),
        help="Comma-separated presets: int8, int8-kivi, int4, int2, int4-token, fp8, "
        "fp8-static, int8-static, float; add overrides after a colon, e.g. 'int4:residual=64' (use ';' between schemes then); "
        "evict=POLICY with its keys adds eviction, e.g. 'float:evict=h2o,budget=512;int4:evict=window,budget=1024'.",
    ),
    context: int = typer.Option(2048, help="Tokens per evaluation sequence, decoded through the cache."),
    samples: int = typer.Option(1, help="Evaluation sequences (a recipe's kv_cache stage decodes 32 by default; one gives no interval)."),
    step: int = typer.Option(1, min=1, help="Tokens per decoding step (1: token by token; more: faster, eviction every step tokens)."),
    batch: int = typer.Option(1, min=1, help="Sequences decoded through the cache at once."),
    needles: int = typer.Option(-1, min=-1, help="Needle rows per scheme (-1: 8 for schemes that evict, none otherwise)."),
    decode_prefill: int = typer.Option(1024, help="Prompt tokens in the cache before the decode-speed repeats."),
    memory_gib: str = typer.Option("8,24,80", help="Comma-separated device memory budgets for the memory plan."),
) -> None:
    """KV-cache schemes against the full-precision cache: bytes, KL at long context, decode speed, memory plan."""
    from pydantic import ValidationError

    from compress.eval.bench.kv import markdown_table, parse_scheme, run_kv_bench
    from compress.progress import Reporter

    parts = schemes.split(";") if ";" in schemes else schemes.split(",")
    evaluate = {"context": context, "samples": samples, "step": step, "batch": batch, "needles": None if needles < 0 else needles}
    try:
        parsed = [parse_scheme(s.strip(), evaluate) for s in parts if s.strip()]
        budgets = [float(b) for b in memory_gib.split(",") if b.strip()]
    except (ValueError, ValidationError) as exc:
        raise CompressError(f"--schemes/--memory-gib: {exc}") from None
    data = replace(opts, eval_samples=samples, eval_seq_len=context).data()
    opts.claim()
    result = run_kv_bench(
        opts.model,
        data,
        parsed,
        opts.output,
        opts.threads,
        Reporter(err),
        context,
        samples,
        opts.decode_tokens,
        decode_prefill,
        opts.repeats,
        budgets,
    )
    opts.results(markdown_table(result))


@bench_command(
    "memory",
    "torch CPU threads of each run.",
    model=("reference:smollm2-135m", "Model source: reference:smollm2-135m, reference:qwen2.5-coder-1.5b, or a Hugging Face folder."),
)
def bench_memory(
    opts: BenchOptions,
    methods: str = typer.Option("rtn,gptq", help="Comma-separated methods, each run at W4 g128 symmetric."),
    cut_blocks: int = typer.Option(4, min=1, help="Blocks of the cut copy the model is compared with."),
    set_: list[str] | None = SET_OPTION,
    keep_files: bool = typer.Option(False, help="Keep the cut copy and the runs' artifacts under OUTPUT/files."),
) -> None:
    """Peak RSS per phase, peak RSS / checkpoint size and seconds per block of `compress run` (a fresh
    process each) on the model and on a copy cut to --cut-blocks blocks: does memory grow with depth?"""
    from compress.eval.bench.memory import markdown_table, run_memory_bench
    from compress.plugins import QUANT_METHODS
    from compress.progress import Reporter

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in QUANT_METHODS]
    if unknown or not chosen:
        raise CompressError(f"--methods: unknown or none ({', '.join(unknown)}); known: {', '.join(QUANT_METHODS)}")
    data = opts.data()
    opts.claim()
    result = run_memory_bench(opts.model, data, chosen, cut_blocks, opts.output, opts.threads, Reporter(err), set_ or [], keep_files)
    opts.results(markdown_table(result))


def _numbers(text: str, parse: Callable[[str], Any], option: str, least: float) -> list[Any]:
    """Comma-separated numbers, each at least ``least`` and given once; else an input error naming ``option``."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CompressError(f"{option} '{text}': expected comma-separated numbers") from None
    if any(v < least for v in values):
        raise CompressError(f"{option} '{text}': each value must be at least {least:g}")
    if len(set(values)) < len(values):
        raise CompressError(f"{option} '{text}': a value is given more than once")
    return values


@bench_command("draft", "llama.cpp threads (n_threads) and torch CPU threads.", ("evaluation", "repeats"))
def bench_draft(
    opts: BenchOptions,
    target: str = typer.Option(
        ..., help="The target: a GGUF file (run in llama.cpp), or a Hugging Face folder or reference:NAME (run in transformers)."
    ),
    drafts: str = typer.Option("", help="Comma-separated drafts on the target's runtime: GGUF files, or Hugging Face folders."),
    cut: str = typer.Option(
        "",
        help="Comma-separated block counts N: a draft made from the GGUF target by keeping its first N blocks "
        "(tensors copied as they are), the no-training baseline.",
    ),
    k: str = typer.Option("2,4,6,8", "--k", help="Comma-separated draft tokens proposed per target pass (each at least 1)."),
    temperatures: str = typer.Option("0,0.8", help="Comma-separated sampling temperatures; 0 is greedy."),
    prompts: int = typer.Option(16, min=1, help="Prompts: the first --prompt-tokens tokens of this many evaluation chunks."),
    prompt_tokens: int = typer.Option(128, min=2, help="Tokens per prompt."),
    max_new: int = typer.Option(64, min=1, help="Tokens generated per prompt."),
    keep_files: bool = typer.Option(False, help="Keep the cut drafts under OUTPUT/files."),
) -> None:
    """Drafts for speculative decoding against the target alone: acceptance per target pass and position, speed-up, greedy identity, draft cost."""
    from compress.eval.bench.draft import markdown_table, run_draft_bench
    from compress.progress import Reporter

    ks = _numbers(k, int, "--k", 1)
    temps = _numbers(temperatures, float, "--temperatures", 0)
    cuts = _numbers(cut, int, "--cut", 1)
    names = [d.strip() for d in drafts.split(",") if d.strip()]
    if not ks or not temps:
        raise CompressError("--k and --temperatures need at least one value each")
    if not names and not cuts:
        raise CompressError("--drafts / --cut: give at least one draft (a file or folder, or a cut of the target)")
    opts.claim()
    result = run_draft_bench(
        target,
        names,
        cuts,
        opts.evaluation,
        opts.output,
        opts.threads,
        Reporter(err),
        ks,
        temps,
        prompts,
        prompt_tokens,
        max_new,
        opts.repeats,
        keep_files,
    )
    opts.results(markdown_table(result))


@bench_command("latency", "Threads per runtime.", ())
def bench_latency(
    opts: BenchOptions,
    artifact: Path = typer.Argument(
        ..., help="A compress artifact directory (its torch model and runtime exports), GGUF file or ONNX folder."
    ),
    runtimes: str | None = typer.Option(
        None, help="Comma-separated runtimes to time (torch, llama.cpp, onnxruntime, tensorrt); default all."
    ),
    rounds: int = typer.Option(2, min=2, help="Independent rounds (fresh processes) to compare."),
    prompt_tokens: int = typer.Option(128, min=1, max=MAX_LATENCY_TOKENS),
    output_tokens: int = typer.Option(64, min=2, max=MAX_LATENCY_TOKENS),
    batch: int = typer.Option(4, min=1, max=MAX_LATENCY_BATCH, help="The batch size measured besides 1."),
    warmup: int = typer.Option(1, min=0, max=100),
    repeats: int = typer.Option(5, min=1, max=1000),
) -> None:
    """Time each runtime of ARTIFACT in several independent rounds: medians, p90, and the spread between rounds."""
    from compress.eval.bench.latency import markdown_table, run_latency_bench
    from compress.eval.latency import LatencySettings
    from compress.progress import Reporter

    settings = LatencySettings(prompt_tokens, output_tokens, tuple(sorted({1, batch})), warmup, repeats, opts.threads)
    chosen = [r.strip() for r in runtimes.split(",")] if runtimes else None
    opts.claim()
    result = run_latency_bench(artifact, chosen, settings, rounds, opts.output, Reporter(err))
    opts.results(markdown_table(result))
