"""The model behind ``polar-train serve``: token-by-token generation with a KV cache, sampling and
raw logprobs, plus scoring of given completion tokens (scripted mode).

Why hand-rolled instead of ``model.generate``: the server must stream tokens as they are produced,
report the *raw* log-softmax of the unscaled logits (what vLLM reports by default), and compute the
248k-wide ``lm_head`` only at the positions that need it. Each request generates in its own worker
thread; a lock around every forward step lets concurrent requests interleave step by step.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from ..tokenizer import load_tokenizer
from .detokenizer import Detokenizer

#: Positions per ``lm_head`` chunk when scoring a long completion (bounds the logits' memory).
SCORE_CHUNK = 256


@dataclass
class SamplingParams:
    """What a request asks of the sampler (already validated by the wire layer)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: vLLM's extensions (chat completions), with its semantics:
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    #: special tokens left out of the text (vLLM's default; off when tools are parsed: its hermes
    #: tool parser's ``adjust_request``); stop strings are searched in that text
    skip_special_tokens: bool = True

    @property
    def stream_holdback(self) -> int:
        """Characters a stream holds back because they may start a stop string (vLLM's
        ``stop_buffer_length``: the longest stop string's length minus one)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes the distribution."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_ids
                    or self.min_tokens or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty)


@dataclass
class Finish:
    """Why generation ended: ``stop`` (stop token or string) or ``length``."""

    reason: str
    stop_reason: str | int | None = None
    #: where the text ends (a matched stop string cut away), ``None``: all of it
    text_end: int | None = None
    #: the last token ended generation as a stop token and is not part of the text
    drop_last: bool = False


@dataclass
class TokenStep:
    """One completion token with its raw logprob and the top alternatives (id, logprob).

    The last token of a completion carries ``finish`` (so a stream can end on that chunk)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    finish: Finish | None = None
    #: the (up to 4) tokens sampled before this one: vLLM names a token that ends in half a
    #: UTF-8 character by what it completes in this context (see Engine.logprob_token)
    before: tuple[int, ...] = ()


def model_stop_ids(tokenizer, model) -> frozenset[int]:
    """The tokens an answer ends at, as vLLM takes them: the tokenizer's ``eos_token`` and the
    generation config's ``eos_token_id`` (one id or a list; ``config.json``'s where the model has
    no generation_config.json). Fixed to ChatML's ``<|im_end|>``/``<|endoftext|>``, a Llama-3 or
    Gemma model never stopped (and an unknown name counted the tokenizer's ``<unk>`` as a stop)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for tid in listed if isinstance(listed, (list, tuple)) else [listed]:
        if isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0:
            ids.add(tid)
    return frozenset(ids)


class Engine:
    """One model, shared by all requests. Thread-safe: forward steps are serialised by a lock."""

    def __init__(self, model_dir: str | Path, adapter: str | Path | None = None,
                 seed: int | None = None, max_model_len: int = 4096) -> None:
        from ..model_load import ModelLoadError, adapter_base_note, first_line, load_adapter, load_causal_lm

        self.model_dir = Path(model_dir)
        try:  # first: the tokenizer's loader reads config.json too, and a typo there was blamed on the tokenizer
            from transformers import AutoConfig

            AutoConfig.from_pretrained(str(self.model_dir))
        except Exception as exc:  # noqa: BLE001 - wrong types are huggingface_hub's own error
            raise ModelLoadError(f"cannot load the model in {self.model_dir}: its config.json: "
                                 f"{first_line(exc)}") from None
        self.tokenizer = load_tokenizer(self.model_dir)
        model = load_causal_lm(self.model_dir, torch.float32)
        if adapter is not None:
            model = load_adapter(model, adapter).merge_and_unload()
            if (note := adapter_base_note(adapter, self.model_dir)) is not None:
                print(f"polar-train serve: {note}", file=sys.stderr, flush=True)
        model.eval()
        self.model = model
        #: the transformer without its head (``model`` for Llama/Qwen, ``transformer`` for GPT-2)
        self.backbone = model.base_model
        self.head = model.get_output_embeddings()
        if self.backbone is model or self.head is None:
            raise ModelLoadError(f"cannot serve the model in {self.model_dir}: {type(model).__name__} has no "
                                 "separate transformer and output head")
        self.max_model_len = max_model_len
        self._text_config = model.config.get_text_config()  # (a multimodal config nests the text model's)
        self.vocab_size = int(self._text_config.vocab_size)
        #: the longest token's text: a prompt longer than max_model_len times this cannot fit
        self.max_chars_per_token = max(len(t) for t in self.tokenizer.get_vocab())
        self.stop_token_ids = model_stop_ids(self.tokenizer, model)
        if not self.stop_token_ids:
            print(f"polar-train serve: warning: the model in {self.model_dir} names no end-of-sequence token "
                  "(tokenizer eos_token, generation_config.json eos_token_id): an answer ends only at max_tokens "
                  "or a stop string", file=sys.stderr, flush=True)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._check_logits()

    def _check_logits(self) -> None:
        """The model's own forward against serve's split one (transformer, then the head at the
        positions that need it): an architecture whose forward changes the logits after its head
        (Gemma-2's final soft-capping, Granite's scaling) was served 0.7 nats off, unsaid."""
        from ..model_load import ModelLoadError

        ids = [i % self.vocab_size for i in range(7, 7 + 5 * 97, 97)]
        with torch.inference_mode():
            theirs = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
            ours = self._logits(self._hidden(ids, None, 0))
        worst = float((theirs - ours).abs().max())
        if not worst <= 1e-3 * max(1.0, float(theirs.abs().max())):
            raise ModelLoadError(f"cannot serve the model in {self.model_dir}: {type(self.model).__name__}'s logits "
                                 f"are not its head's output (they differ by up to {worst:.3g}): its forward "
                                 "changes them in a way polar-train serve does not reproduce")

    # -- token text -------------------------------------------------------------------------

    @lru_cache(maxsize=65536)  # noqa: B019 - one engine per process
    def token_text(self, token_id: int) -> str:
        """The token as vLLM names it in logprobs (``decode([id])``, specials included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_token(self, token_id: int, before: Sequence[int] = ()) -> str:
        """The token's name in logprobs as vLLM 0.32 gives it: ``decode([id])``, except that a
        token whose text ends in U+FFFD (half a UTF-8 character) is named by the text it
        completes after the up to 4 tokens sampled before it, or ``""`` when it completes
        nothing (vLLM's LogprobsProcessor._correct_decoded_token)."""
        text = self.token_text(token_id)
        if not text.endswith("\ufffd"):
            return text
        return self._completed_text(token_id, tuple(before[-4:]))

    @lru_cache(maxsize=65536)  # noqa: B019 - one engine per process
    def _completed_text(self, token_id: int, context: tuple[int, ...]) -> str:
        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = decode([*ctx, token_id])
            if full.endswith("\ufffd"):
                continue
            clean_end = len(ctx)  # context tokens that were half characters themselves
            while clean_end > 0 and self.token_text(ctx[clean_end - 1]).endswith("\ufffd"):
                clean_end -= 1
            prefix = decode(ctx[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    # -- model ------------------------------------------------------------------------------

    def _hidden(self, ids: Sequence[int], cache, start: int):
        inp = torch.tensor([list(ids)], dtype=torch.long)
        pos = torch.arange(start, start + len(ids), dtype=torch.long)[None]
        out = self.backbone(input_ids=inp, cache=cache, use_cache=cache is not None, position_ids=pos)
        return out.last_hidden_state[0]

    def _logits(self, hidden) -> torch.Tensor:
        logits = self.head(hidden).float()
        config = self._text_config
        # what the architectures' forwards do after the head (transformers' Gemma2/3, Granite, Cohere)
        if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
            logits = torch.tanh(logits / cap) * cap
        if (scale := getattr(config, "logits_scaling", None)) not in (None, 1, 1.0):
            logits = logits / scale
        if (scale := getattr(config, "logit_scale", None)) not in (None, 1, 1.0):
            logits = logits * scale
        return logits

    def _generator(self, seed: int | None) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        return g

    @staticmethod
    def _top(logprobs: torch.Tensor, sampled: int, k: int) -> list[tuple[int, float]]:
        """vLLM's list: the sampled token first, then the k best, de-duplicated, cut to k."""
        if k <= 0:
            return []
        vals, idx = torch.topk(logprobs, k)
        out = [(sampled, float(logprobs[sampled]))]
        for v, i in zip(vals.tolist(), idx.tolist()):
            if i != sampled:
                out.append((i, v))
        return out[:k]

    @staticmethod
    def _top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
        """Mask all but the smallest set of best tokens whose probability reaches ``top_p``.

        A full sort of 248k logits costs ~90 ms on CPU; the nucleus of a trained model is
        usually within the best 1024, so try those first and sort everything only if not."""
        probs = torch.softmax(scaled, -1)
        for k in (1024, probs.numel()):
            k = min(k, probs.numel())
            vals, idx = torch.topk(probs, k) if k < probs.numel() else torch.sort(probs, descending=True)
            cum = torch.cumsum(vals, -1)
            if k == probs.numel() or cum[-1] >= top_p:
                keep = int(torch.searchsorted(cum, torch.tensor([top_p], dtype=cum.dtype))) + 1
                mask = torch.full_like(scaled, float("-inf"))
                mask[idx[:keep]] = 0.0
                return scaled + mask
        raise AssertionError("unreachable")

    @staticmethod
    def _process(logits: torch.Tensor, prompt_ids: Sequence[int], output: list[int],
                 p: SamplingParams, model_stops: frozenset[int] = frozenset()) -> torch.Tensor:
        """vLLM's logits processing before temperature, in its order: allowed ids, bad words,
        min_tokens and logit_bias, then repetition (prompt + output), frequency and presence
        (output) penalties."""
        if not p.shapes_logits():
            return logits
        logits = logits.clone()
        if p.allowed_token_ids is not None:
            mask = torch.ones_like(logits, dtype=torch.bool)
            mask[list(p.allowed_token_ids)] = False
            logits.masked_fill_(mask, float("-inf"))
        for word in p.bad_words_ids:
            prefix = word[:-1]
            if len(output) >= len(prefix) and (not prefix or output[-len(prefix):] == prefix):
                logits[word[-1]] = float("-inf")
        if len(output) < p.min_tokens:
            stops = set(p.stop_token_ids) | set(model_stops)
            logits[list(stops)] = float("-inf")
        for tid, bias in p.logit_bias.items():
            logits[tid] += bias
        if p.repetition_penalty != 1.0:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[list(set(prompt_ids) | set(output))] = True
            scale = torch.where(logits > 0, 1.0 / p.repetition_penalty, p.repetition_penalty)
            logits = torch.where(seen, logits * scale, logits)
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output), minlength=logits.numel()).to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @classmethod
    def _sample(cls, logits: torch.Tensor, logprobs: torch.Tensor, p: SamplingParams,
                gen: torch.Generator, processed: bool = False) -> int:
        """``logits``: already processed (:meth:`_process`) when ``processed``."""
        if p.temperature <= 1e-5:
            return int(torch.argmax(logits))
        plain = (p.temperature == 1.0 and not processed and not p.top_k and p.top_p >= 1.0
                 and not p.min_p)
        if plain:
            probs = logprobs.exp()
        else:
            scaled = logits / p.temperature if p.temperature != 1.0 else logits
            if p.min_p:  # vLLM: tokens below min_p x the best probability are dropped
                pr = torch.softmax(scaled, -1)
                scaled = scaled.masked_fill(pr < p.min_p * pr.max(), float("-inf"))
            if p.top_k and 0 < p.top_k < scaled.numel():
                kth = torch.topk(scaled, p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if p.top_p < 1.0:
                scaled = cls._top_p_mask(scaled, p.top_p)
            probs = torch.softmax(scaled, -1)
        # Inverse-CDF sampling with one uniform number: exact, and ~20x cheaper on CPU than an
        # exponential race or torch.multinomial over 248k tokens. Zero-probability tokens have a
        # flat CDF and are never picked.
        cdf = torch.cumsum(probs.double(), 0)
        u = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
        return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[TokenStep]:
        """Yield completion tokens one by one; the last carries its :class:`Finish`. Blocking."""
        from transformers import DynamicCache

        gen = self._generator(params.seed)
        cache = DynamicCache(config=self.model.config)
        ids = list(prompt_ids)
        feed, pos = ids, 0
        output: list[int] = []
        stops = StopStrings(self, params)
        for n in range(params.max_tokens):
            if cancelled():
                return
            with self._lock, torch.inference_mode():
                hidden = self._hidden(feed, cache, pos)[-1]
                logits = self._logits(hidden)
                logprobs = torch.log_softmax(logits, -1)
                processed = self._process(logits, ids, output, params, self.stop_token_ids)
                tok = self._sample(processed, logprobs, params, gen, processed is not logits)
                step = TokenStep(tok, float(logprobs[tok]), self._top(logprobs, tok, params.top_logprobs))
            pos += len(feed)
            feed = [tok]
            output.append(tok)
            step.finish = self._check_stop(output, params, stops)
            if step.finish is None and n + 1 == params.max_tokens:
                step.finish = Finish("length", None)
            yield step
            if step.finish is not None:
                return

    def _check_stop(self, output: list[int], p: SamplingParams, stops: "StopStrings") -> Finish | None:
        """vLLM's order: no stop before ``min_tokens``; then the model's stop tokens (unless
        ``ignore_eos``), the request's ``stop_token_ids`` (named in ``stop_reason``), then stop
        strings in the text (the stop token itself only printed with include_stop_str_in_output)."""
        tok = output[-1]
        if len(output) < p.min_tokens:
            stops.extend(output, check=False)
            return None
        keep = p.include_stop_str_in_output
        if tok in self.stop_token_ids and not p.ignore_eos:
            # vLLM names a generation-config eos other than the tokenizer's in stop_reason
            named = None if tok == self.tokenizer.eos_token_id else tok
            return Finish("stop", named, drop_last=not keep)
        if tok in p.stop_token_ids:
            return Finish("stop", tok, drop_last=not keep)
        return stops.extend(output, check=len(output) > p.min_tokens)

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
              top_logprobs: int = 0) -> list[TokenStep]:
        """The model's raw logprobs of given completion tokens (one forward pass, chunked head)."""
        if not completion_ids:
            return []
        ids = list(prompt_ids) + list(completion_ids)
        n_prompt = len(prompt_ids)
        steps: list[TokenStep] = []
        with self._lock, torch.inference_mode():
            hidden = self._hidden(ids, None, 0)
            positions = hidden[n_prompt - 1: len(ids) - 1]
            for start in range(0, len(completion_ids), SCORE_CHUNK):
                chunk = torch.log_softmax(self._logits(positions[start:start + SCORE_CHUNK]), -1)
                for row, tok in zip(chunk, completion_ids[start:start + SCORE_CHUNK]):
                    steps.append(TokenStep(tok, float(row[tok]), self._top(row, tok, top_logprobs)))
        return steps

    def prompt_logprobs(self, prompt_ids: Sequence[int],
                        k: int = 0) -> list[dict[int, tuple[float, int]] | None]:
        """vLLM's ``prompt_logprobs`` (what chat ``echo`` returns): ``None`` for the first token,
        then each prompt token's raw logprob and rank (the count of logprobs at least as high, as
        vLLM counts it), followed by the ``k`` best (ranks 1..k), as ``{id: (logprob, rank)}``."""
        out: list[dict[int, tuple[float, int]] | None] = [None]
        if len(prompt_ids) < 2:
            return out
        with self._lock, torch.inference_mode():
            hidden = self._hidden(prompt_ids, None, 0)[:-1]
            for start in range(0, len(prompt_ids) - 1, SCORE_CHUNK):
                chunk = torch.log_softmax(self._logits(hidden[start:start + SCORE_CHUNK]), -1)
                for row, tok in zip(chunk, prompt_ids[start + 1:start + 1 + SCORE_CHUNK]):
                    entry = {tok: (float(row[tok]), int((row >= row[tok]).sum()))}
                    if k > 0:
                        vals, idx = torch.topk(row, k)
                        for rank, (v, i) in enumerate(zip(vals.tolist(), idx.tolist()), 1):
                            entry.setdefault(i, (v, rank))
                    out.append(entry)
        return out


class StopStrings:
    """Stop strings found in the decoded output as vLLM's detokenizer finds them: only in text
    after the first ``min_tokens`` tokens, the match that completes first, the text cut before it
    (or after it with ``include_stop_str_in_output``)."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.detokenizer = Detokenizer(engine.tokenizer, params.skip_special_tokens)
        self.checked_from = 0  # text before this offset was searched already

    def extend(self, output: list[int], check: bool) -> Finish | None:
        p = self.params
        if not p.stop:
            return None
        text = self.detokenizer.feed(output)
        if not check:
            self.checked_from = len(text)  # no match may end in the first min_tokens tokens' text
            return None
        best: tuple[int, int, str] | None = None
        for s in p.stop:
            # vLLM's check_stop_strings: a match may start in text searched before (even the first
            # min_tokens tokens') as long as it ends in the new text
            i = text.find(s, max(0, self.checked_from - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s)
        self.checked_from = len(text)
        if best is None:
            return None
        end, start, s = best
        return Finish("stop", s, text_end=end if p.include_stop_str_in_output else start)
