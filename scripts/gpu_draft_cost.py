"""What speculative decoding's two costs are on a GPU, for issue 56's Qwen2.5-Coder-1.5B target and its
distilled draft: the target's time to verify n = k + 1 tokens in one call against one token, and the
draft's time per token against the target's. On the 2-core CPU these decide that no draft pays
(docs/draft.md: verifying 2 tokens costs the target 2.1-2.7x one token there); this measures them
where decoding is memory-bound. For a lent GPU machine (scripts/gpu_checks.sh runs it); CI has none.

The models are built from their configurations (the shapes are the artifact's: the target's
``model/config.json``, the draft's ``draft/model/config.json``) with random weights: the time of a
forward pass does not depend on the weights' values, and the real weights cannot travel to the GPU
machine (1.2 GB and 0.66 GB against its 64 MiB transfer limit). Acceptance does depend on them, so it
is not measured here; docs/draft.md combines these costs with the acceptance measured on the CPU.

Each model runs in transformers (eager Python, ``sdpa`` attention, bfloat16, batch 1) after a
``--prompt``-token prefill; a step's time is the median of ``--repeats`` calls, each followed by
cropping the cache back, so every call sees the same cache length. These are eager steps, as
transformers' assisted generation runs them: Python's launch overhead is in them (CUDA graphs and
fused kernels, as serving stacks use, make every step cheaper and verification relatively dearer).

    python scripts/gpu_draft_cost.py [--json OUT.json] [--prompt 128] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

COMMON = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
TARGET = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2}
DRAFT = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 128,
}
"""The draft of docs/draft.md: 8 of 28 blocks, hidden 768, one KV group of 6 heads of 128, MLP 2,048 (10.7% of the target)."""


def build(shape: dict, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**COMMON, **shape)
    config._attn_implementation = "sdpa"
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def step_seconds(model: torch.nn.Module, prompt: int, counts: list[int], repeats: int, device: torch.device) -> dict[int, float]:
    """Median seconds of one forward pass over each of ``counts`` new tokens after a ``prompt``-token
    cache; the counts take turns within each repeat, so a drift in the machine's speed reaches all alike."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    ids = torch.randint(0, COMMON["vocab_size"], (1, prompt + max(counts)), device=device)
    cache = DynamicCache(config=model.config)
    model(ids[:, :prompt], past_key_values=cache, use_cache=True)
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for i in range(repeats + 3):
        for n in counts:
            sync(device)
            start = time.perf_counter()
            model(ids[:, prompt : prompt + n], past_key_values=cache, use_cache=True)
            sync(device)
            if i >= 3:  # warm-up rounds first
                runs[n].append(time.perf_counter() - start)
            cache.crop(-n)  # back to the prompt
            assert cache.get_seq_length() == prompt, cache.get_seq_length()
    return {n: statistics.median(r) for n, r in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-new", type=int, default=9, help="verify up to this many tokens in one call (k + 1)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script's own code")
    args = parser.parse_args()
    device = torch.device(args.device)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompt": args.prompt,
        "repeats": args.repeats,
        "runtime": "transformers, eager, sdpa attention, bfloat16, batch 1",
    }
    import transformers

    report["transformers"] = transformers.__version__
    target = build(TARGET, device)
    report["target_parameters"] = sum(p.numel() for p in target.parameters())
    report["target_seconds"] = step_seconds(target, args.prompt, list(range(1, args.max_new + 1)), args.repeats, device)
    one = report["target_seconds"][1]
    report["verify_cost"] = {n: t / one for n, t in report["target_seconds"].items()}
    del target
    draft = build(DRAFT, device)
    report["draft_parameters"] = sum(p.numel() for p in draft.parameters())
    report["draft_seconds"] = step_seconds(draft, args.prompt, [1], args.repeats, device)[1]
    report["draft_cost"] = report["draft_seconds"] / one
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
