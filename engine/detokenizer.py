"""Incremental detokenization and stop strings.

Text is produced token by token without ever emitting half a UTF-8 character: a token whose
bytes end mid-character decodes to U+FFFD, so its text is held until a later token completes
it. Text that might be the beginning of a stop string is also held back, so a stream never
shows a client characters that a stop string later removes.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context so the first output token spaces right


class IncrementalDetokenizer:
    """Owns one sequence's output text.

    Offsets into ``_ids`` (context + output tokens)::

        _ids:  [ ...already emitted... | prefix_offset .. read_offset | new tokens ]
                                         ^ text already produced from these, kept as
                                           context so merges with new tokens decode right
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""
        self._num_emitted = 0  # chars of output_text already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string it completed, if any (the text
        is then cut before it, or after it with include_stop_str_in_output)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # incomplete character (or nothing visible yet): wait for more tokens
        new_text = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += new_text
        return self._check_stop(len(new_text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self._stops:
            return None
        # a match must overlap the new text: start the search max_stop_len - 1 chars before it
        search_from = max(0, len(self.output_text) - num_new_chars - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + (len(stop) if self._include_stop else 0)]
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could start a stop string."""
        text = self.output_text
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def replay(self, token_ids: list[int]) -> None:
        """Consume tokens whose text was handed out before (a sequence resumed on another
        worker), token by token as they were then: the state after it, held-back text
        included, is the one that worker had, and none of their text comes out again."""
        for token_id in token_ids:
            self.add_token(token_id)
            self.take_delta(finished=False)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that is safe to show (all of it once finished)."""
        upto = len(self.output_text) if finished else len(self.output_text) - self._held_back()
        upto = max(upto, self._num_emitted)
        delta = self.output_text[self._num_emitted : upto]
        self._num_emitted = upto
        return delta
