"""KV-cache eviction: a transformers Cache whose layers keep a chosen subset of the tokens, per KV head.

Each layer holds two parts, per KV head (grouped-query attention: one policy per KV head, scored by
the attention of every query head of its group):

- the **store**: the tokens a policy may evict, in position order, as attention reads them (float16,
  or quantized and read back exactly as :class:`~compress.quantizers.kv_cache_store.QuantizedKVCache`
  does); heads may keep different numbers of tokens (fastgen), so each head's row is padded and a
  ``valid`` mask says which entries are held;
- the **window**: the newest tokens, not yet quantized (up to ``residual`` of them; none with
  ``format: float``), never evicted; when it fills it is quantized as one block (KIVI's layout,
  per-channel keys included) and joins the store.

After each attention call the policy scores the store and evicts down to what it keeps
(``evict.budget`` tokens per head, the window included, for window/h2o/snapkv; each head's profiled
policy for fastgen). Attention runs through :func:`evicting_attention`, registered with transformers'
``AttentionInterface`` and switched on around a decode by :func:`evicting_attention_on`: it masks
each head's evicted entries and hands the attention probabilities back to the layer (H2O's heavy
hitters, SnapKV's recent-query scores). A cached token keeps its rotary position, so positions stay
those of the full sequence.

Bytes held are counted from what is kept: each held entry's stored size (codes and per-token scales,
or float16), plus per-channel key blocks' scales while any token of the block is held, plus the
window; the cache records them after every step (``held`` per sequence), so evaluation reports the
bytes at the end, their peak and their mean per token.
"""

from __future__ import annotations

import contextlib
import math
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from compress.errors import CompressError
from compress.quantizers.kv_cache_config import EvictConfig, KVCacheConfig
from compress.quantizers.kv_cache_store import dequantize_block, quantize_block

ATTENTION_NAME = "compress_evict"
PROFILE_FILE = "kv_cache/evict_profile.safetensors"
# FastGen's hybrid policies, cheapest first; a head takes the first that recovers `recovery` of its attention.
FASTGEN_POLICIES = ("special", "special+punct", "special+punct+frequent", "special+punct+frequent+local", "full")
SPECIAL, PUNCT = 1, 2  # token flag bits


# --------------------------------------------------------------------------- token tables


@dataclass
class TokenTables:
    """Per vocabulary id: ``flags`` bit SPECIAL (the tokenizer's special tokens), bit PUNCT (a token
    whose text is punctuation only, spaces aside): fastgen's 'special' and 'punct' policies."""

    flags: torch.Tensor  # uint8 [vocab]

    def of(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clamp(0, self.flags.numel() - 1)
        return self.flags.to(ids.device)[ids]


def token_tables(tokenizer: Any, vocab_size: int) -> TokenTables:
    flags = torch.zeros(vocab_size, dtype=torch.uint8)
    for i in getattr(tokenizer, "all_special_ids", None) or []:
        if 0 <= i < vocab_size:
            flags[i] |= SPECIAL
    if tokenizer is not None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        for i, piece in enumerate(pieces):
            text = tokenizer.convert_tokens_to_string([piece]).strip() if piece else ""
            if text and all(unicodedata.category(c).startswith("P") for c in text):
                flags[i] |= PUNCT
    return TokenTables(flags)


# --------------------------------------------------------------------------- byte accounting


def entry_bytes(cfg: KVCacheConfig, head_dim: int) -> tuple[float, float, float]:
    """(bytes of one stored token of one KV head, K and V together; bytes of one per-channel block's
    scales per head; bytes of one float16 window token per head)."""
    window = 2 * head_dim * 2
    if cfg.format == "float":
        return window, 0.0, window
    params = 0 if cfg.static_scales else (1 if cfg.is_symmetric else 2)
    per_token, per_block = 0.0, 0.0
    for axis in (cfg.key_axis, cfg.value_axis):
        per_token += head_dim * cfg.bits / 8
        if axis == "channel":
            per_block += params * 2 * head_dim
        else:
            per_token += params * 2 * math.ceil(head_dim / (cfg.group_size or head_dim))
    return per_token, per_block, window


# --------------------------------------------------------------------------- the cache


@dataclass
class StepTokens:
    """Shared by the layers of one cache: the current step's token flags, and the bytes held per
    sequence (with the tokens seen) after each step."""

    flags: torch.Tensor | None = None  # uint8 [B, q]
    held: list[float] = field(default_factory=list)  # bytes held per sequence after each step
    seen: list[int] = field(default_factory=list)


class EvictingKVLayer(DynamicLayer):
    """One attention layer's evicting cache (see the module docstring)."""

    is_croppable = False

    def __init__(
        self,
        cfg: KVCacheConfig,
        head_policy: torch.Tensor | None,
        tokens: StepTokens,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        assert cfg.evict is not None
        self.cfg, self.ev = cfg, cfg.evict
        self.head_policy = head_policy  # fastgen: [kv_heads] index into FASTGEN_POLICIES
        self.tokens = tokens
        self.k_scale, self.v_scale = k_scale, v_scale
        self.seen = 0
        self.awaiting = 0  # new tokens whose attention has not been observed yet
        self.block_count = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.head_dim = d
        empty = key_states.new_zeros(b, h, 0, d)
        self.s_k, self.s_v = empty, empty.clone()  # the store
        self.s_pos = torch.zeros(b, h, 0, dtype=torch.long, device=self.device)
        self.s_valid = torch.zeros(b, h, 0, dtype=torch.bool, device=self.device)
        self.s_score = torch.zeros(b, h, 0, dtype=torch.float32, device=self.device)
        self.s_flags = torch.zeros(b, h, 0, dtype=torch.uint8, device=self.device)
        self.s_block = torch.zeros(b, h, 0, dtype=torch.long, device=self.device)
        rd = self.cfg.residual_dtype
        self.window_dtype = (
            torch.float16 if self.cfg.format == "float" or rd == "float16" else (key_states.dtype if rd == "model" else torch.bfloat16)
        )
        self.w_k = key_states.new_zeros(b, h, 0, d, dtype=self.window_dtype)  # the window, as stored
        self.w_v = self.w_k.clone()
        self.w_score = torch.zeros(b, h, 0, dtype=torch.float32, device=self.device)
        self.w_flags = torch.zeros(b, h, 0, dtype=torch.uint8, device=self.device)
        self.keys, self.values = empty, empty.clone()  # DynamicLayer's fields, unused
        self.is_initialized = True

    # ---- what attention reads

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.awaiting:
            raise CompressError(
                "the evicting KV cache was read by an attention that did not report back: decode under "
                "compress.quantizers.kv_evict.evicting_attention_on(model)"
            )
        q = key_states.shape[-2]
        b, h = key_states.shape[:2]
        flags = self.tokens.flags
        flags = torch.zeros(b, q, dtype=torch.uint8, device=self.device) if flags is None else flags.to(self.device)
        self.w_k = torch.cat([self.w_k, key_states.to(self.window_dtype)], dim=-2)
        self.w_v = torch.cat([self.w_v, value_states.to(self.window_dtype)], dim=-2)
        self.w_score = torch.cat([self.w_score, self.w_score.new_zeros(b, h, q)], dim=-1)
        self.w_flags = torch.cat([self.w_flags, flags[:, None, :].expand(b, h, q)], dim=-1)
        self.seen += q
        self.awaiting = q
        keys = torch.cat([self.s_k, self.w_k.to(self.dtype)], dim=-2).to(key_states.dtype)
        values = torch.cat([self.s_v, self.w_v.to(self.dtype)], dim=-2).to(value_states.dtype)
        return keys, values

    def attention_bias(self, q: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, KV heads, q, store + window]: 0 where a query may attend, -inf elsewhere (evicted store
        entries; the newest ``q`` window tokens causally)."""
        b, h, n = self.s_valid.shape
        w = self.w_k.shape[-2]
        allowed = torch.ones(b, h, q, n + w, dtype=torch.bool, device=self.device)
        allowed[..., :n] = self.s_valid[:, :, None, :]
        new = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        allowed[..., n + w - q :] = new
        bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return bias.masked_fill(~allowed, float("-inf"))

    def observe(self, probs: torch.Tensor) -> None:
        """The attention probabilities of this step, summed over each KV head's query heads and the
        step's queries ([B, KV heads, store + window]): score the entries, then quantize and evict."""
        n = self.s_k.shape[-2]
        if self.ev.policy == "snapkv":
            decay = 1.0 - 1.0 / self.ev.observe
            self.s_score = self.s_score * decay + probs[..., :n]
            self.w_score = self.w_score * decay + probs[..., n:]
        else:
            self.s_score = self.s_score + probs[..., :n]
            self.w_score = self.w_score + probs[..., n:]
        self.awaiting = 0
        self._flush()
        self._evict()

    # ---- quantizing the window, evicting from the store

    def _flush(self) -> None:
        block = 0 if self.cfg.format == "float" else self.cfg.residual
        w = self.w_k.shape[-2]
        n = w if block == 0 else (w // block) * block
        if n == 0:
            return
        if self.cfg.format == "float":
            kd, vd = self.w_k[..., :n, :].to(self.dtype), self.w_v[..., :n, :].to(self.dtype)
            ids = torch.full(self.w_score[..., :n].shape, -1, dtype=torch.long, device=self.device)
        else:
            kds, vds, blocks = [], [], []
            k_dim = -2 if self.cfg.key_axis == "channel" else -1
            v_dim = -2 if self.cfg.value_axis == "channel" else -1
            for start in range(0, n, block or n):
                stop = start + (block or n)
                k = quantize_block(self.w_k[..., start:stop, :], self.cfg, k_dim, self.k_scale)
                v = quantize_block(self.w_v[..., start:stop, :], self.cfg, v_dim, self.v_scale)
                kds.append(dequantize_block(k, self.cfg, self.dtype, self.k_scale))
                vds.append(dequantize_block(v, self.cfg, self.dtype, self.v_scale))
                blocks.append(torch.full(self.w_score[..., start:stop].shape, self.block_count, dtype=torch.long, device=self.device))
                self.block_count += 1
            kd, vd, ids = torch.cat(kds, dim=-2), torch.cat(vds, dim=-2), torch.cat(blocks, dim=-1)
        w_pos = torch.arange(self.seen - w, self.seen - w + n, device=self.device).expand_as(ids)
        self.s_k = torch.cat([self.s_k, kd], dim=-2)
        self.s_v = torch.cat([self.s_v, vd], dim=-2)
        self.s_pos = torch.cat([self.s_pos, w_pos], dim=-1)
        self.s_valid = torch.cat([self.s_valid, torch.ones_like(ids, dtype=torch.bool)], dim=-1)
        self.s_score = torch.cat([self.s_score, self.w_score[..., :n]], dim=-1)
        self.s_flags = torch.cat([self.s_flags, self.w_flags[..., :n]], dim=-1)
        self.s_block = torch.cat([self.s_block, ids], dim=-1)
        self.w_k, self.w_v = self.w_k[..., n:, :], self.w_v[..., n:, :]
        self.w_score, self.w_flags = self.w_score[..., n:], self.w_flags[..., n:]

    def _priority(self) -> tuple[torch.Tensor, int]:
        """Each store entry's claim to stay ([B, H, N], -inf: evict) and how many a head may keep."""
        ev, seen = self.ev, self.seen
        if ev.policy == "fastgen":
            return self._fastgen_priority(), self.s_pos.shape[-1]
        pos, valid = self.s_pos, self.s_valid
        inf = torch.tensor(float("inf"), device=self.device)
        sink = pos < ev.sink
        keep = max(0, ev.budget - self.w_k.shape[-2])  # the window counts against the budget
        if ev.policy == "window":
            score = pos.float()
        else:
            score = self.s_score
            if ev.policy == "snapkv" and ev.pool > 1:
                score = torch.nn.functional.max_pool1d(
                    score.masked_fill(~valid, 0).flatten(0, 1)[:, None], ev.pool, stride=1, padding=ev.pool // 2
                ).view_as(score)
            score = torch.where(pos >= seen - ev.window, inf, score)
        score = torch.where(sink, inf, score)
        return score.masked_fill(~valid, float("-inf")), keep

    def _fastgen_priority(self) -> torch.Tensor:
        ev, seen = self.ev, self.seen
        pos, valid, flags = self.s_pos, self.s_valid, self.s_flags
        assert self.head_policy is not None
        policy = self.head_policy.to(self.device)[None, :, None]  # [1, H, 1] index into FASTGEN_POLICIES
        special = (pos < ev.sink) | ((flags & SPECIAL) > 0)
        punct = (flags & PUNCT) > 0
        local = pos >= seen - math.ceil(ev.local * seen)
        k = min(math.ceil(ev.frequent * seen), pos.shape[-1])
        score = self.s_score.masked_fill(~valid, float("-inf"))
        frequent = torch.zeros_like(valid)
        if k > 0:
            frequent.scatter_(-1, score.topk(k, dim=-1).indices, True)
        keep = special.clone()
        keep |= punct & (policy >= 1)
        keep |= frequent & (policy >= 2)
        keep |= local & (policy >= 3)
        keep |= policy >= 4
        keep &= valid
        return torch.where(keep, pos.float(), torch.tensor(float("-inf"), device=self.device))

    def _evict(self) -> None:
        n = self.s_pos.shape[-1]
        if n == 0:
            return
        priority, keep = self._priority()
        if self.ev.policy == "fastgen":
            keep = int((priority > float("-inf")).sum(-1).max())
        if keep >= n:  # nothing to drop from the arrays; the heads' policies may still mark entries evicted
            self.s_valid = priority > float("-inf")
            return
        keep = min(keep, n)
        idx = priority.topk(keep, dim=-1).indices.sort(dim=-1).values
        chosen = priority.gather(-1, idx) > float("-inf")

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 4:
                return t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))
            return t.gather(-1, idx)

        self.s_k, self.s_v = take(self.s_k), take(self.s_v)
        self.s_pos, self.s_score, self.s_flags, self.s_block = take(self.s_pos), take(self.s_score), take(self.s_flags), take(self.s_block)
        self.s_valid = chosen

    # ---- accounting

    def held_bytes(self) -> torch.Tensor:
        """Bytes this layer holds per sequence [B] (see :func:`entry_bytes`)."""
        if not self.is_initialized:
            return torch.zeros(1)
        per_token, per_block, _ = entry_bytes(self.cfg, self.head_dim)
        window = 2 * self.head_dim * self.w_k.element_size()
        held = self.s_valid.sum(dim=(1, 2)).double() * per_token + self.w_k.shape[-2] * self.w_k.shape[1] * window
        if per_block and self.block_count:
            alive = torch.zeros(*self.s_valid.shape[:2], self.block_count, dtype=torch.long, device=self.device)
            alive.scatter_add_(-1, self.s_block.clamp(min=0), (self.s_valid & (self.s_block >= 0)).long())
            held += (alive > 0).sum(dim=(1, 2)).double() * per_block
        return held.cpu()

    def kept_tokens(self) -> torch.Tensor:
        """Tokens held per KV head [B, H] (store and window)."""
        return self.s_valid.sum(-1) + self.w_k.shape[-2]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        raise CompressError("the evicting KV cache builds its own attention masks; decode under evicting_attention_on(model)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise CompressError("the evicting KV cache does not support beam search reordering; use greedy or sampling")


class EvictingKVCache(Cache):
    """A Cache of :class:`EvictingKVLayer`, one per decoder layer. Feed each step's token ids with
    :meth:`set_tokens` (fastgen's special and punctuation tokens) and decode under
    :func:`evicting_attention_on`."""

    def __init__(
        self,
        cfg: KVCacheConfig,
        num_layers: int,
        tables: TokenTables | None,
        profile: torch.Tensor | None = None,
        scales: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.tables = tables
        self.step = StepTokens()
        ks = scales["k_scale"] if scales else None
        vs = scales["v_scale"] if scales else None
        layers = [
            EvictingKVLayer(
                cfg, None if profile is None else profile[i], self.step, None if ks is None else ks[i], None if vs is None else vs[i]
            )
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)

    def set_tokens(self, ids: torch.Tensor) -> None:
        self.step.flags = self.tables.of(ids) if self.tables is not None else None

    def record(self) -> None:
        """Note the bytes held per sequence now (after a step)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return
        held = sum(layer.held_bytes() for layer in layers)
        self.step.held.append(float(held.mean()))
        self.step.seen.append(layers[0].seen)


# --------------------------------------------------------------------------- attention


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention of query [B, Hq, q, D] over key/value [B, Hkv, n, D] with ``bias`` [B, Hkv, q, n]
    (None: causal, the queries being the last q of the n): (output [B, q, Hq, D], probabilities
    [B, Hq, q, n] in float32)."""
    q, d = query.shape[-2:]
    groups = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else d**-0.5
    scores = torch.matmul(query, key.repeat_interleave(groups, dim=1).transpose(2, 3)).float() * scale
    if bias is not None:
        scores = scores + bias.repeat_interleave(groups, dim=1)
    else:
        n = key.shape[-2]
        causal = torch.ones(q, n, dtype=torch.bool, device=query.device).tril(n - q)
        scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(value.dtype), value.repeat_interleave(groups, dim=1))
    return out.transpose(1, 2).contiguous(), probs


def _plain_attention_only(kwargs: dict[str, Any]) -> None:
    for name in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(name) is not None:
            raise CompressError(f"KV-cache eviction supports plain full attention; this model's attention uses {name}")


def evicting_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention over an evicting cache layer: each KV head's held entries, then the layer sees
    the probabilities. Without an active evicting cache (a forward with no cache) it is plain causal
    attention, so a model switched to it still runs."""
    _plain_attention_only(kwargs)
    layer = _ACTIVE.layer(module)
    if layer is None:
        return _attend(query, key, value, scaling, None)[0], None
    b, hq, q, _ = query.shape
    hkv = key.shape[1]
    out, probs = _attend(query, key, value, scaling, layer.attention_bias(q, torch.float32))
    layer.observe(probs.view(b, hkv, hq // hkv, q, -1).sum(dim=(2, 3)))
    return out, None


class _Active:
    """The evicting cache the current decode step reads (one at a time; set by cached decoding)."""

    cache: EvictingKVCache | None = None

    def layer(self, module: torch.nn.Module) -> EvictingKVLayer | None:
        if self.cache is None:
            return None
        return self.cache.layers[module.layer_idx]


_ACTIVE = _Active()


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, evicting_attention)


@contextlib.contextmanager
def evicting_attention_on(model: torch.nn.Module, cache: EvictingKVCache | None = None) -> Iterator[None]:
    """Run ``model``'s attention through :func:`evicting_attention` (reading ``cache``) inside the block."""
    _register()
    config = model.config
    before = config._attn_implementation
    previous = _ACTIVE.cache
    config._attn_implementation = ATTENTION_NAME
    _ACTIVE.cache = cache
    try:
        yield
    finally:
        config._attn_implementation = before
        _ACTIVE.cache = previous


# --------------------------------------------------------------------------- fastgen profiling


class _Profiler:
    """Collects, per layer and KV head, how much attention each FastGen policy recovers and keeps."""

    def __init__(self, ev: EvictConfig, layers: int, kv_heads: int) -> None:
        self.ev = ev
        self.recovered = torch.zeros(layers, kv_heads, len(FASTGEN_POLICIES), dtype=torch.float64)
        self.kept = torch.zeros_like(self.recovered)
        self.rows = 0
        self.flags: torch.Tensor | None = None  # [T] of the current sequence

    def add(self, layer: int, probs: torch.Tensor) -> None:
        """probs [KV heads, T, T] (mean over each head's query group) of one sequence."""
        assert self.flags is not None
        ev = self.ev
        h, t, _ = probs.shape
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        causal = j <= i
        special = ((j < ev.sink) | ((self.flags[None, :] & SPECIAL) > 0)) & causal
        punct = ((self.flags[None, :] & PUNCT) > 0) & causal
        local = (j > i - torch.ceil(ev.local * (i + 1))) & causal
        cum = probs.double().cumsum(dim=1).masked_fill(~causal, float("-inf"))
        rank = cum.argsort(dim=-1, descending=True).argsort(dim=-1)
        frequent = (rank < torch.ceil(ev.frequent * (i + 1))) & causal
        masks = [special, special | punct]
        masks.append(masks[-1] | frequent)
        masks.append(masks[-1] | local)
        masks.append(causal.expand(h, t, t))
        count = (i + 1).double()
        for p, mask in enumerate(masks):
            m = mask.expand(h, t, t)
            self.recovered[layer, :, p] += (probs.double() * m).sum(-1).sum(-1)
            self.kept[layer, :, p] += (m.sum(-1).double() / count[:, 0]).sum(-1)
        if layer == 0:
            self.rows += t

    def choose(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy index per layer and KV head, its recovered share, its kept share)."""
        recovered = self.recovered / max(self.rows, 1)
        kept = self.kept / max(self.rows, 1)
        ok = recovered >= self.ev.recovery - 1e-9
        ok[..., -1] = True  # full always recovers everything
        choice = ok.float().argmax(dim=-1)
        return choice, recovered.gather(-1, choice[..., None])[..., 0], kept.gather(-1, choice[..., None])[..., 0]


@torch.no_grad()
def profile_heads(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    ev: EvictConfig,
    tables: TokenTables,
    device: torch.device,
    geometry: tuple[int, int],
    reporter: Any = None,
) -> dict[str, torch.Tensor]:
    """FastGen's profile on calibration rows ``tokens`` [samples, seq]: for each layer and KV head the
    cheapest policy of FASTGEN_POLICIES whose kept tokens receive at least ``ev.recovery`` of the
    head's attention (averaged over every query position of every row); ``geometry``: (layers, KV heads)."""
    profiler = _Profiler(ev, *geometry)

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        scaling: float | None = None,
        **k: Any,
    ) -> Any:
        _plain_attention_only(k)
        out, probs = _attend(query, key, value, scaling, None)
        hkv, t = key.shape[1], key.shape[-2]
        profiler.add(module.layer_idx, probs[0].view(hkv, -1, t, t).mean(dim=1).cpu())
        return out, None

    from transformers import AttentionInterface

    name = ATTENTION_NAME + "_profile"
    AttentionInterface.register(name, record)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    rows = list(tokens)
    it = reporter.track(rows, "kv_cache: profiling fastgen's per-head policies") if reporter else rows
    try:
        for row in it:
            profiler.flags = tables.of(row)
            model(input_ids=row[None].to(device), use_cache=False)
    finally:
        config._attn_implementation = before
    choice, recovered, kept = profiler.choose()
    return {"policy": choice.to(torch.int8), "recovered": recovered.float(), "kept": kept.float()}


def fastgen_inputs(
    model: torch.nn.Module,
    tokenizer: Any,
    calibration: torch.Tensor | None,
    ev: EvictConfig,
    geometry: tuple[int, int],
    device: torch.device,
    reporter: Any = None,
) -> tuple[TokenTables, dict[str, torch.Tensor]]:
    """fastgen's token tables and per-head profile: ``ev.profile`` loaded and checked, or measured on
    ``ev.profile_samples`` rows of ``ev.profile_context`` tokens cut from the calibration tokens."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tables = token_tables(tokenizer, config.vocab_size)
    if ev.profile is not None:
        return tables, load_profile(ev.profile, *geometry)
    if calibration is None:
        raise CompressError("evict: fastgen profiles its heads on calibration text; give some, or set evict.profile")
    flat = calibration.flatten()
    rows = min(ev.profile_samples, flat.numel() // ev.profile_context)
    if rows == 0:
        raise CompressError(
            f"evict.profile_context {ev.profile_context} is longer than the calibration text ({flat.numel():,} tokens); "
            "lower it or add calibration samples"
        )
    tokens = flat[: rows * ev.profile_context].view(rows, ev.profile_context)
    return tables, profile_heads(model, tokens, ev, tables, device, geometry, reporter)


# --------------------------------------------------------------------------- the stored profile


def load_profile(path: str | Path, layers: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """A stored fastgen profile, checked: the file (an artifact folder or the safetensors file) exists,
    holds ``policy`` [layers, kv_heads] with indices into FASTGEN_POLICIES and shares in [0, 1]."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        p = p / PROFILE_FILE
    if not p.is_file():
        raise CompressError(f"evict.profile: {p} does not exist (an artifact folder with {PROFILE_FILE}, or that file)")
    if p.stat().st_size > 16 * 2**20:
        raise CompressError(f"evict.profile: {p} is {p.stat().st_size:,} bytes; a profile is a few KiB")
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise CompressError(f"evict.profile: {p} is not a readable safetensors file ({e})") from e
    policy = tensors.get("policy")
    if policy is None or tuple(policy.shape) != (layers, kv_heads):
        shape = None if policy is None else tuple(policy.shape)
        raise CompressError(f"evict.profile: {p} holds policy {shape}, but this model has {layers} layers x {kv_heads} KV heads")
    if policy.dtype.is_floating_point or int(policy.min()) < 0 or int(policy.max()) >= len(FASTGEN_POLICIES):
        raise CompressError(f"evict.profile: {p} has policy indices outside 0..{len(FASTGEN_POLICIES) - 1}")
    for name in ("recovered", "kept"):
        t = tensors.get(name)
        if t is None or tuple(t.shape) != (layers, kv_heads) or not bool(((t >= 0) & (t <= 1 + 1e-6)).all()):
            raise CompressError(f"evict.profile: {p} lacks {name} [{layers}, {kv_heads}] with shares in [0, 1]")
    return {"policy": policy.to(torch.int8), "recovered": tensors["recovered"].float(), "kept": tensors["kept"].float()}


def profile_summary(profile: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Heads per policy and the mean kept / recovered shares, for the stage record."""
    policy = profile["policy"].long()
    return {
        "heads_per_policy": {name: int((policy == i).sum()) for i, name in enumerate(FASTGEN_POLICIES)},
        "mean_kept_share": round(float(profile["kept"].mean()), 4),
        "mean_recovered_share": round(float(profile["recovered"].mean()), 4),
    }
