"""From tokens to what a caller reads: text, stop strings, logprob dicts, ``RequestOutput``s.

The scheduler appends a step's tokens to its requests (and finishes them on the token rules);
:class:`OutputProcessor` then turns the tokens it has not seen yet into text, one at a time
(:class:`~specserve.engine.detokenizer.IncrementalDetokenizer`: the cost per token does not grow
with the output), looks for stop strings in the new text, keeps the logprob dicts the request asked
for, and builds one :class:`~specserve.outputs.RequestOutput` per request that advanced. A stop
string ends a request through the scheduler (``finish``), with the tokens after it dropped.
"""
from __future__ import annotations

from typing import Callable

from specserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from specserve.engine.request import Request
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.worker.step import StepResult

# (request, reason, stop reason, output tokens to keep): the scheduler's ``finish``
FinishFn = Callable[[Request, str, "int | str | None", "int | None"], None]


def logprob_dict(token: int, logprob: float, top: dict[int, float]) -> dict[int, Logprob]:
    """One position's ``{token id: Logprob}``: the top tokens with their ranks (1 = most likely),
    and ``token`` (the chosen or given one) with its logprob, ranked only if it is among them."""
    entry = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(top.items())}
    entry.setdefault(token, Logprob(logprob))
    return entry


class OutputProcessor:
    """The text side of every request in the engine.

    Args:
        tokenizer: a transformers tokenizer (detokenization).
        finish: the scheduler's :meth:`~specserve.engine.scheduler.Scheduler.finish`, called when
            a stop string ends a request.
    """

    def __init__(self, tokenizer, finish: FinishFn):
        self.tokenizer = tokenizer
        self.finish = finish
        self.requests: dict[str, list[Request]] = {}   # request id -> its n sequences
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}   # by seq id, while unfinished

    def add(self, request_id: str, seqs: list[Request]) -> None:
        self.requests[request_id] = seqs
        for s in seqs:
            self._detokenizers[s.seq_id] = IncrementalDetokenizer(self.tokenizer, s.params.skip_special_tokens)

    def pop(self, request_id: str) -> list[Request]:
        """Forget a request (aborted); returns its sequences (none for an unknown id)."""
        seqs = self.requests.pop(request_id, [])
        for s in seqs:
            self._detokenizers.pop(s.seq_id, None)
        return seqs

    def process(self, requests: list[Request], result: StepResult) -> list[RequestOutput]:
        """Take in one step (``requests[b]`` is row b of ``result``; the scheduler has applied it):
        prompt logprobs, then each new output token's logprobs, text and stop strings. Returns the
        outputs of the requests that got tokens (finished ones are forgotten)."""
        advanced = {}
        for b, req in enumerate(requests):
            if result.prompt_logprobs is not None and result.prompt_logprobs[b] is not None:
                first, entries = result.prompt_logprobs[b]
                for i, (lp, top) in enumerate(entries, start=first):
                    if i == len(req.prompt_logprobs):   # a recompute after preemption scores them again
                        req.prompt_logprobs.append(logprob_dict(req.prompt_token_ids[i], lp, top))
            if result.new_token_ids[b]:
                logprobs = result.logprobs[b] if result.logprobs is not None else None
                self._take_tokens(req, logprobs)
                advanced[req.request_id] = None
        return [self._output(rid) for rid in advanced if rid in self.requests]

    def _take_tokens(self, req: Request, logprobs: list | None) -> None:
        """The output tokens of ``req`` this processor has not seen, in order (``logprobs[j]``:
        the entry of the step's j-th new token; the scheduler appended a prefix of the step's tokens)."""
        detok = self._detokenizers.get(req.seq_id)
        if detok is None:
            return
        params, tokens = req.params, req.output_token_ids
        seen = len(detok.ids)   # every token before the last is fed to the detokenizer
        last = len(tokens) - 1
        for j, token in enumerate(tokens[seen:], start=seen):
            if logprobs is not None and req.logprobs is not None:
                lp, top = logprobs[j - seen]
                req.logprobs.append(logprob_dict(token, lp, top))
                req.cumulative_logprob += lp
            if j == last and req.is_finished and req.finish_reason != "length":
                # the token that ended it (EOS, a stop token id, one the output constraint refused):
                # a stop token's text is kept only if asked for, the others' never
                if (req.finish_reason == "stop" and params.include_stop_str_in_output
                        and token in req.stop_token_ids):
                    detok.add(token)
                break
            prev_len = len(detok.text)
            detok.add(token)
            req.text = detok.text
            hit = find_stop_string(req.text, params.stop, prev_len) if params.stop else None
            if hit is not None:
                idx, stop = hit
                req.text = req.text[:idx + len(stop)] if params.include_stop_str_in_output else req.text[:idx]
                self.finish(req, "stop", stop, j + 1)
                self._detokenizers.pop(req.seq_id)
                return
        if req.is_finished:
            req.text = detok.final_text()
            self._detokenizers.pop(req.seq_id)

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        out = self.make_output(seqs)
        if out.finished:
            del self.requests[request_id]
        return out

    @staticmethod
    def make_output(seqs: list[Request]) -> RequestOutput:
        """The :class:`RequestOutput` of a request's sequences, as they stand."""
        first = seqs[0]
        completions = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in seqs]
        finished = all(s.is_finished for s in seqs)
        first_token = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
        metrics = RequestMetrics(first.arrival_time, first_token,
                                 max((s.finished_time or 0.0) for s in seqs) if finished else None,
                                 spec_decode=first.spec_stats if len(seqs) == 1 else None)
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions,
                             finished, metrics, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
