"""Token-level enforcement of a `ToolCallGrammar`: a lazily built DFA and the engine-facing constraint.

Contract:
* `LazyDfa(grammar)` numbers grammar states as they are first reached and memoises transitions
  per (state, byte) in 256-entry rows, so testing a token costs a list lookup per byte once the
  states it crosses have been seen. It is shared by every request with the same grammar
  (transitions are deterministic): `shared_dfa(grammar)` returns it, a fresh one once it has
  passed `MAX_DFA_STATES`.
* `token_table(tokenizer)` is the per-tokenizer (module-level, weakly keyed) cache of token
  bytes, filled lazily one id at a time; ids at or beyond the tokenizer's vocabulary (the padded
  rows of a model head) are never allowed.
* `ToolCallConstraint` implements the engine's `TokenConstraint`: `allowed(id)` runs the token's
  bytes from the current state without changing it; `advance(id)` moves to the state after the
  token (`ValueError` for a token that is not allowed). EOS ids are allowed exactly in final
  states; added (special) tokens are matched by their text but never inside a JSON string or a
  free-text value; everything else by its raw bytes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from freetoken_agent.constrain.grammar import State, ToolCallGrammar
from freetoken_agent.tokenizer import ChatTokenizer

MAX_DFA_STATES = 20_000  # about 2 KB a state
_UNKNOWN = -2
_REJECT = -1
_SLOW = 256  # index of an always-unknown slot: a row has 256 byte entries plus this one


_SHARED_LOCK = threading.Lock()


def shared_dfa(grammar: ToolCallGrammar) -> LazyDfa:
    """The lazily built DFA every request with `grammar` shares (kept on the grammar)."""
    with _SHARED_LOCK:
        if grammar.dfa is None or len(grammar.dfa.states) > MAX_DFA_STATES:
            grammar.dfa = LazyDfa(grammar)
        return grammar.dfa


class LazyDfa:
    """States of a grammar numbered on first sight; `trans[sid][byte]` is the next id, -1 reject, -2 unknown."""

    def __init__(self, grammar: ToolCallGrammar) -> None:
        self.grammar = grammar
        self.states: list[State] = []
        self.trans: list[list[int]] = []
        self.final: list[bool] = []
        self.textual: list[bool] = []
        self._ids: dict[State, int] = {}
        self._lock = threading.Lock()

    def intern(self, state: State) -> int:
        sid = self._ids.get(state)
        if sid is None:
            with self._lock:
                sid = self._ids.get(state)
                if sid is None:
                    sid = len(self.states)
                    self.states.append(state)
                    self.trans.append([_UNKNOWN] * 257)
                    self.final.append(self.grammar.is_final(state))
                    self.textual.append(self.grammar.is_textual(state))
                    self._ids[state] = sid
        return sid

    def compute(self, sid: int, b: int) -> int:
        """Fill in (and return) the transition of state `sid` on byte `b`."""
        nxt = self.grammar.step(self.states[sid], b)
        result = _REJECT if nxt is None else self.intern(nxt)
        self.trans[sid][b] = result
        return result


class TokenTable:
    """Raw bytes of a tokenizer's tokens, filled on first use (b"" for an id without bytes).

    `first[id]` is the token's first byte for an ordinary token whose bytes are known, else
    `_SLOW` (not yet looked up, added token, or no bytes): the constraint's fast rejection test.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self.size = tokenizer.vocab_size
        self.data: list[bytes | None] = [None] * self.size
        self.first: list[int] = [_SLOW] * self.size
        self.added = frozenset(tokenizer.special_ids.values())

    def fill(self, token_id: int) -> bytes:
        try:
            raw = self._tokenizer.token_bytes(token_id)
        except (KeyError, ValueError):
            raw = b""
        self.data[token_id] = raw
        if raw and token_id not in self.added:
            self.first[token_id] = raw[0]
        return raw


_TABLES: weakref.WeakKeyDictionary[ChatTokenizer, TokenTable] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def token_table(tokenizer: ChatTokenizer) -> TokenTable:
    with _TABLES_LOCK:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenTable(tokenizer)
        return table


class ToolCallConstraint:
    """One request's position in the grammar; the engine's `TokenConstraint`."""

    def __init__(self, grammar: ToolCallGrammar, table: TokenTable, eos_token_ids: Iterable[int]) -> None:
        self.grammar = grammar
        self.forced_prefix = grammar.forced_prefix
        self._dfa = dfa = shared_dfa(grammar)
        self._trans = dfa.trans
        self._final = dfa.final
        self._textual = dfa.textual
        self._table = table
        self._data = table.data
        self._first = table.first
        self._added = table.added
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._sid = dfa.intern(grammar.initial)
        self._row = self._trans[self._sid]
        self._last_token = -1
        self._last_sid = -1
        self.finished = False  # an EOS was accepted

    @property
    def is_complete(self) -> bool:
        """True when the text so far is one or more complete calls (EOS allowed now)."""
        return self._final[self._sid]

    @property
    def state(self) -> State:
        return self._dfa.states[self._sid]

    def allowed(self, token_id: int) -> bool:
        # Fast path: most candidates are refused on their first byte, one list lookup each.
        try:
            if self._row[self._first[token_id]] == _REJECT:
                return False
        except IndexError:
            return False
        return self._allowed(token_id)

    def _allowed(self, token_id: int) -> bool:
        if token_id in self._eos:
            return self._final[self._sid]
        if token_id < 0:
            return False
        data = self._data[token_id]
        if data is None:
            data = self._table.fill(token_id)
        if not data:
            return False
        sid = self._sid
        trans = self._trans
        textual = self._textual
        special = token_id in self._added
        for b in data:
            if special and textual[sid]:
                return False
            nxt = trans[sid][b]
            if nxt < 0:
                if nxt == _REJECT:
                    return False
                nxt = self._dfa.compute(sid, b)
                if nxt < 0:
                    return False
            sid = nxt
        self._last_token = token_id
        self._last_sid = sid
        return True

    def advance(self, token_id: int) -> None:
        if token_id in self._eos:
            if not self._final[self._sid]:
                raise ValueError(f"EOS token {token_id} before the tool call is complete")
            self.finished = True
            return
        if token_id != self._last_token and not self.allowed(token_id):
            raise ValueError(f"token {token_id} is not allowed by the tool-call constraint here")
        self._sid = self._last_sid
        self._row = self._trans[self._sid]
        self._last_token = -1
