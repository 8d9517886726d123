"""Hugging Face generation backend: ``GenerationBackend`` over a causal LM with a kept KV cache.

``HFBackend`` is a manual batched sampling loop over a Hugging Face causal LM with a KV cache
(``transformers`` ``DynamicCache``), written for multi-turn rollouts where every sequence receives its own
tool observation between turns (``model.generate`` takes one prompt per sequence and cannot inject an observation per sequence mid-batch):
- Prefixes are left-padded; every forward pass gets an explicit 2-D attention mask and explicit
  ``position_ids`` (position = number of real tokens before the token), so padding and holes in the cache
  never shift positions or leak attention.
- Identical prefixes in one call (the ``m`` rollouts of a prompt, the ``k`` branches of an anchor) are
  prefilled once and their KV is expanded to the copies by an index select.
- The KV of every sequence of the previous call is kept. A new prefix that extends a kept sequence (the same
  trajectory after its tool observation was appended) feeds only the new tokens; the kept KV is dropped
  when the model's weights version moves (``mark_weights_updated``, which ``trace.update.PolicyUpdater``
  calls after every optimizer step) or on ``clear_cache()``. Kept rows are repacked to their real slots, so
  padding holes do not accumulate from turn to turn.
- Finished sequences are dropped from the working batch once enough of them accumulate.
- Each request samples from its own ``torch.Generator`` seeded with the request's own seed (``request_seeds``:
  one seed per request, which the rollout engine derives from each trajectory's identity, or
  ``request_seed(seed, index)`` for one call seed): the same model, prefix and seed give the same tokens,
  whatever the rest of the batch, its order, the chunking or the prefix sharing.

Logits from cached and expanded KV match a full recompute without cache within about 1e-6 (float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from trace.policy.backends import Generation, request_seeds, sample_tokens
from trace.policy.lora import merged_copy
from trace.policy.weights import weights_version


def _hash_extend(h: int, token_ids: Sequence[int]) -> int:
    """Rolling hash of a token sequence (identity of kept KV rows)."""
    for t in token_ids:
        h = hash((h, t))
    return h


def _cache_kwarg(model: Any) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` (transformers >= 5.24) or ``past_key_values``
    (earlier 5.x, e.g. the 5.19 that vLLM 0.32 pins)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def _output_cache(out: Any) -> Any:
    """The KV cache returned by a forward pass, under either transformers 5.x name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@dataclass
class _KVBlock:
    """KV of a set of finished sequences kept for the next call.

    Attributes:
        keys, values: per layer (R, H, S, D) tensors.
        attention_mask: (R, S) long, 1 on slots that hold a real token.
        next_position: (R,) long, real tokens per row (position id of the next token).
        token_ids: per row, the tokens whose KV the row holds, in order.
    """

    keys: list[Any]
    values: list[Any]
    attention_mask: Any
    next_position: Any
    token_ids: list[tuple[int, ...]]


@dataclass
class _Batch:
    """Working state of the decode loop: KV cache rows, their masks and positions."""

    cache: Any  # DynamicCache, (R, H, S, D) per layer
    attention_mask: Any  # (R, S) long
    next_position: Any  # (R,) long


class HFBackend:
    """Batched sampling with a KV cache over a Hugging Face causal LM (see the module docstring).

    Args:
        model: causal LM taking ``input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep``.
            Eager attention is recommended: left padding creates fully masked query rows.
        tokenizer: its tokenizer (EOS ids, pad id, and decoding for stop strings).
        max_batch_size: most sequences decoded together; larger calls are processed in chunks.
        reuse_prefix_cache: prefill identical prefixes once and expand their KV (off: prefill every copy).
        keep_cache_between_calls: keep the KV of the last call's sequences for prefixes that extend them.
        compact_fraction: drop finished rows from the working batch once the unfinished ones are at most
            this share of it.
        merge_lora: a LoRA policy generates through ``trace.policy.lora.MergedCopy`` (adapters merged into a
            plain copy, reloaded after each announced weight update; one base-sized copy more of memory).

    Attributes:
        stats: running counts: ``prefill_tokens`` (prefix tokens run through the model), ``reused_tokens``
            (prefix tokens served from kept KV), ``decode_steps`` (sampling steps), ``forward_passes``.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int = 256, reuse_prefix_cache: bool = True,
                 keep_cache_between_calls: bool = True, compact_fraction: float = 0.75, merge_lora: bool = True
                 ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.model = model
        self.merged = merged_copy(model) if merge_lora else None
        self._net = model  # what the forward passes run (the merged copy, if any, from generate() on)
        self.tokenizer = tokenizer
        self.max_batch_size = int(max_batch_size)
        self.reuse_prefix_cache = reuse_prefix_cache
        self.keep_cache_between_calls = keep_cache_between_calls
        self.compact_fraction = float(compact_fraction)
        eos: set[int] = set()
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            eos.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        self.eos_token_ids = frozenset(eos)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self._kept: list[_KVBlock] = []
        self._kept_index: dict[tuple[int, int], tuple[int, int]] = {}
        self._kept_version: int | None = None
        self._cache_kwarg = _cache_kwarg(model)
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "forward_passes": 0}

    # ---- kept KV between calls ----------------------------------------------------------------------
    def clear_cache(self) -> None:
        """Drop the KV kept from the previous call."""
        self._kept, self._kept_index, self._kept_version = [], {}, None

    def _find_kept(self, prefix: Sequence[int]) -> tuple[int, int, int] | None:
        """Longest kept row whose tokens are a proper prefix of ``prefix``: ``(block, row, length)``."""
        if not self._kept_index:
            return None
        best = None
        h = 0
        for length, token in enumerate(prefix[:-1], start=1):
            h = hash((h, token))
            hit = self._kept_index.get((length, h))
            if hit is not None:
                best = (hit[0], hit[1], length)
        if best is not None and tuple(prefix[:best[2]]) != self._kept[best[0]].token_ids[best[1]]:
            return None  # hash collision
        return best

    # ---- public API ----------------------------------------------------------------------------------
    def generate(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | Sequence[int] = 0,
    ) -> list[Generation]:
        """Sample one continuation per prefix (``GenerationBackend.generate``).

        Kept KV of the previous call is used only while ``weights_version(model)`` is the one it was computed
        under.

        Raises:
            ValueError: an empty prefix, a negative ``max_new_tokens``, a length mismatch, or bad per-request
                seeds (``request_seeds``).
        """
        import torch

        num = len(prefixes)
        budgets = [int(max_new_tokens)] * num if isinstance(max_new_tokens, int) else [int(b) for b in max_new_tokens]
        if len(budgets) != num:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {num} prefixes")
        for idx, (prefix, budget) in enumerate(zip(prefixes, budgets)):
            if len(prefix) == 0:
                raise ValueError(f"prefixes[{idx}] is empty: every prefix needs at least one token (e.g. BOS)")
            if budget < 0:
                raise ValueError(f"max_new_tokens[{idx}]={budget} must be >= 0")
        seeds = request_seeds(seed, num)
        if self._kept and self._kept_version != weights_version(self.model):
            self.clear_cache()
        self._net = self.merged.module() if self.merged is not None else self.model
        device = next(self._net.parameters()).device
        # one random stream per request: its tokens do not depend on batching, chunking or prefix sharing
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        results: list[Generation | None] = [None] * num
        # group identical prefixes (first-occurrence order) so each is prefilled once
        groups: dict[tuple[int, ...], list[int]] = {}
        for idx, prefix in enumerate(prefixes):
            if budgets[idx] == 0:
                results[idx] = Generation(finish="length")
                continue
            key = tuple(int(t) for t in prefix)
            groups.setdefault(key if self.reuse_prefix_cache else (idx,) + key, []).append(idx)
        entries = []  # (prefix, request indices) split to fit max_batch_size
        for key, members in groups.items():
            prefix = key if self.reuse_prefix_cache else key[1:]
            for start in range(0, len(members), self.max_batch_size):
                entries.append((prefix, members[start:start + self.max_batch_size]))
        chunks: list[list[tuple[tuple[int, ...], list[int]]]] = []
        rows_in_chunk = self.max_batch_size
        for entry in entries:
            if rows_in_chunk + len(entry[1]) > self.max_batch_size:
                chunks.append([])
                rows_in_chunk = 0
            chunks[-1].append(entry)
            rows_in_chunk += len(entry[1])
        new_kept: list[_KVBlock] = []
        stop_ids = frozenset(int(t) for t in stop_token_ids)
        with torch.inference_mode():
            for chunk in chunks:
                self._generate_chunk(chunk, budgets, results, new_kept, temperature, top_p, stop_ids,
                                     tuple(stop_strings), generators, device)
        if self.keep_cache_between_calls:
            self._kept = new_kept
            self._kept_index = {}
            for block_idx, block in enumerate(new_kept):
                for row, tokens in enumerate(block.token_ids):
                    self._kept_index[(len(tokens), _hash_extend(0, tokens))] = (block_idx, row)
            self._kept_version = weights_version(self.model)
        else:
            self.clear_cache()
        return [r if r is not None else Generation() for r in results]

    # ---- internals -----------------------------------------------------------------------------------
    def _prefill(self, prefixes: list[tuple[int, ...]], device: Any) -> tuple[_Batch, Any]:
        """Run the uncached part of each prefix through the model; return the batch state and last logits.

        Rows that extend a kept sequence start from its KV and feed only the new tokens; the others start
        empty. New tokens are left-padded to one chunk of width W.
        """
        import torch
        from transformers import DynamicCache

        num = len(prefixes)
        matches = [self._find_kept(p) for p in prefixes]
        used_blocks = sorted({m[0] for m in matches if m is not None})
        # Kept rows carry holes (padding, slots of rows that had finished); only their real slots are copied,
        # right-aligned, so the past is as wide as the longest kept context. Slot order is kept and positions
        # are baked into the keys (rotary), so moving slots changes nothing the attention sees.
        gathers = []  # (block, source rows, destination rows, slot index (n, L), real-slot counts (n,))
        for b in used_blocks:
            block = self._kept[b]
            dest = [i for i, m in enumerate(matches) if m is not None and m[0] == b]
            src = torch.tensor([matches[i][1] for i in dest], dtype=torch.long)
            mask = block.attention_mask[src]  # (n, S)
            counts = mask.sum(dim=1)
            real_first = torch.argsort(1 - mask, dim=1, stable=True)  # real slots first, in order
            gathers.append((block, src, torch.tensor(dest, dtype=torch.long), real_first, counts))
        past_len = max((int(g[4].max()) for g in gathers), default=0)
        next_position = torch.zeros(num, dtype=torch.long)
        past_mask = torch.zeros(num, past_len, dtype=torch.long)
        layer_kv = None
        if gathers:
            first = gathers[0][0]
            layer_kv = []
            for layer in range(len(first.keys)):
                shape = list(first.keys[layer].shape)
                shape[0], shape[2] = num, past_len
                layer_kv.append([first.keys[layer].new_zeros(shape), first.values[layer].new_zeros(shape)])
            column = torch.arange(past_len)
            for block, src, dest, real_first, counts in gathers:
                src_col = column[None, :] - (past_len - counts)[:, None]  # (n, L); < 0 is left padding
                is_real = src_col >= 0
                slot = real_first.gather(1, src_col.clamp(min=0))  # (n, L) slot in the block
                past_mask[dest] = is_real.long()
                next_position[dest] = block.next_position[src]
                src_dev, dest_dev = src.to(device), dest.to(device)
                for layer, (keys, values) in enumerate(layer_kv):
                    k = block.keys[layer].index_select(0, src_dev)  # (n, H, S, D)
                    idx = slot.to(device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                    keys[dest_dev] = k.gather(2, idx)
                    values[dest_dev] = block.values[layer].index_select(0, src_dev).gather(2, idx)
        new_tokens = [p[m[2]:] if m is not None else p for p, m in zip(prefixes, matches)]
        width = max(len(t) for t in new_tokens)
        input_ids = torch.full((num, width), self.pad_token_id, dtype=torch.long)
        chunk_mask = torch.zeros(num, width, dtype=torch.long)
        position_ids = torch.zeros(num, width, dtype=torch.long)
        for row, tokens in enumerate(new_tokens):
            n = len(tokens)
            input_ids[row, width - n:] = torch.tensor(tokens, dtype=torch.long)
            chunk_mask[row, width - n:] = 1
            position_ids[row, width - n:] = next_position[row] + torch.arange(n)
        self.stats["prefill_tokens"] += sum(len(t) for t in new_tokens)
        self.stats["reused_tokens"] += sum(m[2] for m in matches if m is not None)
        cache = DynamicCache(config=self.model.config)
        if layer_kv is not None:
            for layer, (k, v) in enumerate(layer_kv):
                cache.update(k, v, layer)
        attention_mask = torch.cat([past_mask, chunk_mask], dim=1)
        out = self._net(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         position_ids=position_ids.to(device), use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        self.stats["forward_passes"] += 1
        next_position = next_position + torch.tensor([len(t) for t in new_tokens], dtype=torch.long)
        return _Batch(_output_cache(out), attention_mask, next_position), out.logits[:, -1, :]

    def _keep_rows(self, batch: _Batch, rows: list[int], token_ids: list[tuple[int, ...]],
                   new_kept: list[_KVBlock], device: Any) -> None:
        """Copy the KV of working rows ``rows`` (holding ``token_ids``) into a kept block."""
        import torch

        idx = torch.tensor(rows, dtype=torch.long)
        idx_dev = idx.to(device)
        keys = [layer.keys.index_select(0, idx_dev) for layer in batch.cache.layers]
        values = [layer.values.index_select(0, idx_dev) for layer in batch.cache.layers]
        new_kept.append(_KVBlock(keys, values, batch.attention_mask[idx], batch.next_position[idx], token_ids))

    def _generate_chunk(self, chunk, budgets, results, new_kept, temperature, top_p, stop_ids, stop_strings,
                        generators, device) -> None:
        import torch

        prefixes = [prefix for prefix, _ in chunk]
        batch, logits = self._prefill(prefixes, device)
        # expand each unique prefix to its copies: working row -> request index
        requests = [idx for _, members in chunk for idx in members]
        expand = torch.tensor([u for u, (_, members) in enumerate(chunk) for _ in members], dtype=torch.long)
        if len(requests) != len(chunk):
            batch.cache.reorder_cache(expand.to(device))
            batch.attention_mask = batch.attention_mask[expand]
            batch.next_position = batch.next_position[expand]
            logits = logits.index_select(0, expand.to(device))
        row_prefix = [prefixes[u] for u in expand.tolist()]
        generated: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        work = list(range(len(requests)))  # working row -> position in `requests`
        max_stop_len = max((len(s) for s in stop_strings), default=0)
        keep = self.keep_cache_between_calls
        while True:
            uniforms = None
            if temperature > 0:
                uniforms = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).fill_(0.5)
                for w, r in enumerate(work):
                    if finish[r] is None:
                        uniforms[w].uniform_(0.0, 1.0, generator=generators[requests[r]])
            tokens, token_logprobs = sample_tokens(logits, temperature, top_p, uniforms)
            tokens_l, logprobs_l = tokens.tolist(), token_logprobs.tolist()
            self.stats["decode_steps"] += 1
            for w, r in enumerate(work):
                if finish[r] is not None:
                    continue
                token = tokens_l[w]
                generated[r].append(token)
                logprobs[r].append(logprobs_l[w])
                if token in self.eos_token_ids:
                    finish[r] = "eos"
                elif token in stop_ids:
                    finish[r] = "stop"
                elif stop_strings and self._hits_stop_string(generated[r], stop_strings, max_stop_len):
                    finish[r] = "stop"
                elif len(generated[r]) >= budgets[requests[r]]:
                    finish[r] = "length"
            unfinished = [w for w, r in enumerate(work) if finish[r] is None]
            if not unfinished:
                break
            if len(unfinished) <= self.compact_fraction * len(work):
                done = [w for w, r in enumerate(work) if finish[r] is not None]
                if keep:
                    self._keep_rows(batch, done, [row_prefix[work[w]] + tuple(generated[work[w]][:-1]) for w in done],
                                    new_kept, device)
                idx = torch.tensor(unfinished, dtype=torch.long)
                batch.cache.reorder_cache(idx.to(device))
                batch.attention_mask = batch.attention_mask[idx]
                batch.next_position = batch.next_position[idx]
                tokens = tokens.index_select(0, idx.to(tokens.device))
                work = [work[w] for w in unfinished]
                unfinished = list(range(len(work)))
            is_live = torch.zeros(len(work), dtype=torch.long)
            is_live[unfinished] = 1
            batch.attention_mask = torch.cat([batch.attention_mask, is_live[:, None]], dim=1)
            out = self._net(input_ids=tokens[:, None].to(device), attention_mask=batch.attention_mask.to(device),
                             position_ids=batch.next_position[:, None].to(device), use_cache=True,
                             **{self._cache_kwarg: batch.cache})
            self.stats["forward_passes"] += 1
            batch.cache = _output_cache(out)
            batch.next_position = batch.next_position + is_live
            logits = out.logits[:, -1, :]
        if keep:
            self._keep_rows(batch, list(range(len(work))),
                            [row_prefix[r] + tuple(generated[r][:-1]) for r in work], new_kept, device)
        for r, idx in enumerate(requests):
            results[idx] = Generation(token_ids=generated[r], logprobs=logprobs[r], finish=finish[r])

    def _hits_stop_string(self, generated: list[int], stop_strings: tuple[str, ...], max_stop_len: int) -> bool:
        tail = self.tokenizer.decode(generated[-(max_stop_len + 1):], skip_special_tokens=False)
        return any(s in tail for s in stop_strings)
