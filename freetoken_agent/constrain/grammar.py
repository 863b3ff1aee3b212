r"""The tool-call grammar: a byte-level automaton over the text a model writes after a forced prefix.

Contract:
* `ToolCallGrammar(...)` describes the language of one request: one or more tool calls in the
  family's format, the last one followed by nothing (EOS). States are immutable tuples (a stack
  of frames, hashable), so a state can be tested against a token's bytes without being changed;
  `step(state, byte)` returns the next state or None when the byte cannot follow. Every state
  returned by `step` can still be completed (some byte sequence leads to a final state), so a
  constrained model can always finish.
* `initial` is the state right after `forced_prefix`; `is_final(state)` is true exactly after a
  complete call (then only `\n<tool_call>\n` - another call, when parallel calls are allowed -
  or EOS may follow); `is_textual(state)` is true inside JSON strings and free-text values, where
  special (added) tokens are refused.
* Text is handled as UTF-8 bytes: JSON structure is ASCII; string contents and free-text values
  must be valid UTF-8 (no overlongs, no surrogates), so a token holding part of a character is
  accepted where a character may start or continue.

Formats (NAME, KEY from the tools; whitespace exactly as shown unless stated):
* qwen3:   `{"name": NAME_JSON, "arguments":` WS? OBJECT `}\n</tool_call>` where OBJECT is JSON
  following the tool's parameter schema (see `schema.py`).
* qwen3_5: `<function=NAME>\n` then parameters `<parameter=KEY>\nVALUE\n</parameter>\n`, then
  `</function>\n</tool_call>`. VALUE is free UTF-8 text that never contains `</parameter>` (it
  ends at the first `\n</parameter>`; the header's newline also counts, so a value may be empty),
  or, when the parameter's declared types exclude "string", a JSON value of those kinds written
  right after the header's newline. Keys of a closed parameter object come from its schema, each
  at most once; an open object takes any key without whitespace, `<` or `>` (values of keys
  outside `properties` are free text, as the parser reads them), also at most once each.
  `</function>` is allowed once every required key is present. A string `enum` makes VALUE one
  of its members; `maxLength` counts VALUE's characters.
* Calls are separated by `\n<tool_call>\n`; the forced prefix supplies the first `<tool_call>\n`.

JSON checks: objects, arrays, strings (escapes incl. `\uXXXX`, surrogate pairs complete, no raw
control characters), numbers (RFC 8259 syntax, at most 20 digits before and after the point and
3 in the exponent; integers only when the schema says "integer"), literals. Whitespace between
JSON tokens: at most `max_ws` characters per gap (default 2, so that a model cannot stall in
whitespace). Closed objects take only their keys, without repeats, and close once `required`
keys are present; `enum`/`const` values must be written as `json.dumps(v, ensure_ascii=False)`;
`maxLength` (characters) and `maxItems` are enforced. Keys of open objects are free strings and
their values unconstrained JSON (`required` is not checked there).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any, Literal

from freetoken_agent.constrain.schema import ANY, SchemaNode, SchemaTable

Frame = tuple[Any, ...]
State = tuple[Frame, ...]
Action = tuple[Any, ...]

# Frame tags.
(_VALUE, _OBJ, _ARR, _STR, _NUM, _CHOICE, _Q3_CALL, _Q3_ARGS, _X_CALL, _X_PARAMS, _X_KEY, _X_TEXT, _X_JSON,
 _COMPLETE) = range(14)
_TEXTUAL = frozenset({_STR, _X_KEY, _X_TEXT})

# Object / array / number phases.
_O_FIRST, _O_KEY, _O_INKEY, _O_COLON, _O_VALUE, _O_AFTER = range(6)
_A_FIRST, _A_VALUE, _A_AFTER = range(3)
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_DONE = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP})
_MAX_DIGITS = 20  # per integer part / fraction: longer numbers are refused (no tool needs them)
_MAX_EXP_DIGITS = 3

# String escape states: after "\", inside "\uXXXX" (tracking surrogates), expecting a low surrogate.
(_E_NONE, _E_BS, _E_U1, _E_U2, _E_U2D, _E_U3, _E_U4, _E_H3, _E_H4, _E_PL_BS, _E_PL_U, _E_PL_D,
 _E_PL_C) = range(13)

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESC = frozenset(b'"\\/bfnrt')
_BYTE = [bytes((i,)) for i in range(256)]
_QUOTE, _BACKSLASH = ord('"'), ord("\\")

_PARAM_CLOSE = b"\n</parameter>"
_BARE_CLOSE = b"</parameter>"
_PEND = frozenset({_PARAM_CLOSE[:i] for i in range(len(_PARAM_CLOSE) + 1)}
                  | {_BARE_CLOSE[:i] for i in range(len(_BARE_CLOSE) + 1)})
_X_KEY_MAX = 256
_X_BAD_KEY = frozenset(b"<>\x7f") | frozenset(range(0x21))

Family = Literal["qwen3", "qwen3_5"]
DEFAULT_MAX_WS = 2


def _utf8(u8: Any, b: int) -> Any:
    """Next UTF-8 decoder state (0 at a character boundary, else (left, lo, hi)); None if invalid."""
    if u8 == 0:
        if b < 0x80:
            return 0
        if 0xC2 <= b <= 0xDF:
            return (1, 0x80, 0xBF)
        if b == 0xE0:
            return (2, 0xA0, 0xBF)
        if 0xE1 <= b <= 0xEC or b in (0xEE, 0xEF):
            return (2, 0x80, 0xBF)
        if b == 0xED:
            return (2, 0x80, 0x9F)
        if b == 0xF0:
            return (3, 0x90, 0xBF)
        if 0xF1 <= b <= 0xF3:
            return (3, 0x80, 0xBF)
        if b == 0xF4:
            return (3, 0x80, 0x8F)
        return None
    left, lo, hi = u8
    if not lo <= b <= hi:
        return None
    return 0 if left == 1 else (left - 1, 0x80, 0xBF)


def _close_progress(pend: bytes) -> int:
    return len(pend) if _PARAM_CLOSE.startswith(pend) else 0


def _add(used: tuple[str, ...], key: str) -> tuple[str, ...]:
    return tuple(sorted((*used, key)))


def _x_key_ok(key: str) -> bool:
    raw = key.encode("utf-8")
    return bool(raw) and len(raw) <= _X_KEY_MAX and not any(b in _X_BAD_KEY for b in raw)


class _ChoiceSet:
    """Literal alternatives, each with the action taken once it is written in full."""

    __slots__ = ("alts", "prefixes", "proper")

    def __init__(self, alts: dict[bytes, Action]) -> None:
        self.alts = alts
        self.prefixes = frozenset(a[:i] for a in alts for i in range(1, len(a) + 1))
        self.proper = frozenset(a[:i] for a in alts for i in range(len(a)))


class ToolCallGrammar:
    """The language of one request's constrained output (see the module docstring)."""

    def __init__(self, family: Family, names: Sequence[str], parameters: Sequence[Any],
                 callable_tools: Sequence[int], *, named: int | None = None, parallel: bool = True,
                 max_ws: int = DEFAULT_MAX_WS) -> None:
        if family not in ("qwen3", "qwen3_5"):
            raise ValueError(f"unknown tool-call format family {family!r} (expected 'qwen3' or 'qwen3_5')")
        self.family: Family = family
        self.names = list(names)
        self.table = SchemaTable()
        self.args = [self.table.add(p, force_object=True) for p in parameters]
        self.nodes: list[SchemaNode] = self.table.nodes
        self.callable = list(callable_tools)
        self.parallel = parallel
        self.max_ws = max_ws
        self._choices: list[_ChoiceSet] = []
        self._choice_ids: dict[Any, int] = {}
        self._choice_lock = threading.Lock()
        self.dfa: Any = None  # the DFA the requests with this grammar share (constrain/dfa.py `shared_dfa`)
        self._handlers = {
            _VALUE: self._value, _OBJ: self._obj, _ARR: self._arr, _STR: self._str, _NUM: self._num,
            _CHOICE: self._choice, _Q3_CALL: self._q3_call, _X_CALL: self._x_call, _X_PARAMS: self._x_params,
            _X_KEY: self._x_key, _X_TEXT: self._x_text, _COMPLETE: self._complete,
        }
        self._q3_tail = self._lit(b"}\n</tool_call>", ("complete",))
        self._next_call = self._lit(b"\n<tool_call>\n", ("call",))
        if named is None:
            self.forced_prefix = "<tool_call>\n"
            self.initial: State = (((_Q3_CALL,) if family == "qwen3" else (_X_CALL,)),)
        elif family == "qwen3":
            self.forced_prefix = "<tool_call>\n" + self._q3_head(named)
            self.initial = ((_Q3_ARGS, named), (_VALUE, self.args[named], 0))
        else:
            self.forced_prefix = f"<tool_call>\n<function={self.names[named]}>\n"
            self.initial = ((_X_PARAMS, named, ()),)

    # ------------------------------------------------------------------ public
    @staticmethod
    def is_final(state: State) -> bool:
        return len(state) == 1 and state[0][0] == _COMPLETE

    @staticmethod
    def is_textual(state: State) -> bool:
        return bool(state) and state[-1][0] in _TEXTUAL

    def step(self, state: State, b: int) -> State | None:
        """The state after byte `b`, or None when `b` cannot follow `state`."""
        if not state:
            return None
        return self._handlers[state[-1][0]](state, state[-1], b)

    def run(self, state: State | None, data: bytes) -> State | None:
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    def classify(self, text: str | bytes) -> Literal["invalid", "partial", "complete"]:
        """Where `text` (written after the forced prefix) stands: a dead end, unfinished, or complete."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        state = self.run(self.initial, data)
        if state is None:
            return "invalid"
        return "complete" if self.is_final(state) else "partial"

    # ------------------------------------------------------------------ choice sets
    def _choice_set(self, key: Any, build: Any) -> int | None:
        cid = self._choice_ids.get(key)
        if cid is None:
            with self._choice_lock:  # engines on several threads may share this grammar
                cid = self._choice_ids.get(key)
                if cid is None:
                    alts = build()
                    if not alts:
                        return None
                    self._choices.append(_ChoiceSet(alts))
                    cid = self._choice_ids[key] = len(self._choices) - 1
        return cid

    def _lit(self, text: bytes, action: Action) -> int:
        cid = self._choice_set(("lit", text, action), lambda: {text: action})
        assert cid is not None
        return cid

    def _q3_head(self, ti: int) -> str:
        return '{"name": ' + json.dumps(self.names[ti], ensure_ascii=False) + ', "arguments":'

    def _head_choice(self) -> int:
        def build() -> dict[bytes, Action]:
            if self.family == "qwen3":
                return {self._q3_head(ti).encode(): ("q3args", ti) for ti in self.callable}
            return {f"<function={self.names[ti]}>\n".encode(): ("xparams", ti, ()) for ti in self.callable}

        cid = self._choice_set(("head",), build)
        assert cid is not None
        return cid

    def _key_choice(self, nid: int, used: tuple[str, ...]) -> int | None:
        def build() -> dict[bytes, Action]:
            keys = self.nodes[nid].keys
            return {json.dumps(k, ensure_ascii=False)[1:].encode(): ("key", k) for k in keys if k not in used}

        return self._choice_set(("keys", nid, used), build)

    def _literal_choice(self, kinds: frozenset[str]) -> int | None:
        def build() -> dict[bytes, Action]:
            alts: dict[bytes, Action] = {}
            if "boolean" in kinds:
                alts[b"true"] = alts[b"false"] = ("value",)
            if "null" in kinds:
                alts[b"null"] = ("value",)
            return alts

        return self._choice_set(("literal", kinds), build)

    def _enum_choice(self, nid: int) -> int:
        def build() -> dict[bytes, Action]:
            return {json.dumps(v, ensure_ascii=False).encode(): ("value",) for v in self.nodes[nid].enum or ()}

        cid = self._choice_set(("enum", nid), build)
        assert cid is not None
        return cid

    def _x_keys(self, ti: int) -> tuple[str, ...]:
        return tuple(k for k in self.nodes[self.args[ti]].keys if _x_key_ok(k))

    def _x_required(self, ti: int) -> tuple[str, ...]:
        return tuple(k for k in self.nodes[self.args[ti]].required if _x_key_ok(k))

    def _x_param_choice(self, ti: int, used: tuple[str, ...]) -> int:
        def build() -> dict[bytes, Action]:
            alts: dict[bytes, Action] = {}
            if self.nodes[self.args[ti]].closed:
                for k in self._x_keys(ti):
                    if k not in used:
                        alts[f"<parameter={k}>\n".encode()] = ("xparam", ti, used, k)
            else:
                alts[b"<parameter="] = ("xfreekey", ti, used)
            if all(k in used for k in self._x_required(ti)):
                alts[b"</function>\n</tool_call>"] = ("complete",)
            return alts

        cid = self._choice_set(("xparams", ti, used), build)
        assert cid is not None
        return cid

    def _x_enum_choice(self, nid: int, after: Action) -> int | None:
        def build() -> dict[bytes, Action]:
            alts: dict[bytes, Action] = {}
            for v in self.nodes[nid].enum or ():
                text = (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)).encode()
                if _BARE_CLOSE not in text:
                    alts[text + b"\n</parameter>\n"] = after
            return alts

        return self._choice_set(("xenum", nid, after), build)

    # ------------------------------------------------------------------ completion
    def _value_done(self, state: State) -> State:
        """A JSON value (or a free key string) just ended; tell its parent frame."""
        top, base = state[-1], state[:-1]
        tag = top[0]
        if tag == _OBJ:
            phase = _O_AFTER if top[2] == _O_VALUE else _O_COLON
            return (*base, (_OBJ, top[1], phase, top[3], None, 0))
        if tag == _ARR:
            return (*base, (_ARR, top[1], _A_AFTER, top[3] + 1, 0))
        if tag == _Q3_ARGS:
            return (*base, (_CHOICE, self._q3_tail, b""))
        if tag == _X_JSON:
            return (*base, (_CHOICE, self._lit(b"\n</parameter>\n", ("xparams", top[1], top[2])), b""))
        raise AssertionError(f"value ended under frame {top!r}")

    def _act(self, state: State, action: Action) -> State:
        kind = action[0]
        if kind == "value":
            return self._value_done(state)
        if kind == "key":
            top = state[-1]
            return (*state[:-1], (_OBJ, top[1], _O_COLON, _add(top[3], action[1]), action[1], 0))
        if kind == "q3args":
            ti = action[1]
            return (*state, (_Q3_ARGS, ti), (_VALUE, self.args[ti], 0))
        if kind == "complete":
            return (*state, (_COMPLETE,))
        if kind == "call":
            return (*state, ((_Q3_CALL,) if self.family == "qwen3" else (_X_CALL,)))
        if kind == "xparams":
            return (*state, (_X_PARAMS, action[1], action[2]))
        if kind == "xparam":
            return self._start_param(state, action[1], action[2], action[3])
        if kind == "xfreekey":
            return (*state, (_X_KEY, action[1], action[2], b"", 0))
        raise AssertionError(f"unknown action {action!r}")

    def _param_node(self, ti: int, key: str) -> int:
        # A key outside `properties` is free text, as the qwen3_5 parser reads it.
        return self.nodes[self.args[ti]].props.get(key, ANY)

    def _start_param(self, state: State, ti: int, used: tuple[str, ...], key: str) -> State:
        nid = self._param_node(ti, key)
        node = self.nodes[nid]
        used2 = _add(used, key)
        if node.text_mode:
            if node.enum is not None:
                cid = self._x_enum_choice(nid, ("xparams", ti, used2))
                if cid is not None:
                    return (*state, (_CHOICE, cid, b""))
            return (*state, (_X_TEXT, ti, used2, b"\n", 0, node.max_length))
        return (*state, (_X_JSON, ti, used2), (_VALUE, nid, self.max_ws))  # no leading whitespace

    # ------------------------------------------------------------------ frame handlers
    def _choice(self, state: State, top: Frame, b: int) -> State | None:
        cs = self._choices[top[1]]
        prefix = top[2]
        cand = prefix + _BYTE[b]
        if cand in cs.prefixes:
            if cand in cs.alts and cand not in cs.proper:
                return self._act(state[:-1], cs.alts[cand])
            return (*state[:-1], (_CHOICE, top[1], cand))
        if prefix in cs.alts:  # a complete alternative that another one extends: it ends here
            nxt = self._act(state[:-1], cs.alts[prefix])
            return self.step(nxt, b)
        return None

    def _value(self, state: State, top: Frame, b: int) -> State | None:
        _, nid, ws = top
        base = state[:-1]
        if b in _WS:
            return (*base, (_VALUE, nid, ws + 1)) if ws < self.max_ws else None
        node = self.nodes[nid]
        if node.enum is not None:
            return self.step((*base, (_CHOICE, self._enum_choice(nid), b"")), b)
        kinds = node.kinds
        if b == 0x7B:  # {
            return (*base, (_OBJ, nid, _O_FIRST, (), None, 0)) if "object" in kinds else None
        if b == 0x5B:  # [
            return (*base, (_ARR, nid, _A_FIRST, 0, 0)) if "array" in kinds else None
        if b == _QUOTE:
            return (*base, (_STR, 0, _E_NONE, node.max_length)) if "string" in kinds else None
        if b == 0x2D or b in _DIGITS:
            if "number" not in kinds and "integer" not in kinds:
                return None
            phase = _N_MINUS if b == 0x2D else _N_ZERO if b == 0x30 else _N_INT
            return (*base, (_NUM, phase, "number" not in kinds, 0 if b == 0x2D else 1))
        cid = self._literal_choice(kinds)
        return None if cid is None else self.step((*base, (_CHOICE, cid, b"")), b)

    def _obj_more(self, node: SchemaNode, used: tuple[str, ...]) -> bool:
        return not node.closed or any(k not in used for k in node.keys)

    def _obj_can_close(self, node: SchemaNode, used: tuple[str, ...]) -> bool:
        return not node.closed or all(k in used for k in node.required)

    def _obj(self, state: State, top: Frame, b: int) -> State | None:
        _, nid, phase, used, key, ws = top
        base = state[:-1]
        if b in _WS:
            return (*base, (_OBJ, nid, phase, used, key, ws + 1)) if ws < self.max_ws else None
        node = self.nodes[nid]
        if phase in (_O_FIRST, _O_KEY):
            if b == _QUOTE:
                if not node.closed:
                    return (*base, (_OBJ, nid, _O_INKEY, used, None, 0), (_STR, 0, _E_NONE, -1))
                cid = self._key_choice(nid, used)
                if cid is None:
                    return None
                return (*base, (_OBJ, nid, _O_INKEY, used, None, 0), (_CHOICE, cid, b""))
            if b == 0x7D and phase == _O_FIRST and self._obj_can_close(node, used):
                return self._value_done(base)
            return None
        if phase == _O_COLON:
            if b != 0x3A:  # :
                return None
            vid = node.props.get(key, ANY) if key is not None else (node.extra if not node.props else ANY)
            return (*base, (_OBJ, nid, _O_VALUE, used, None, 0), (_VALUE, vid, 0))
        if phase == _O_AFTER:
            if b == 0x2C and self._obj_more(node, used):  # ,
                return (*base, (_OBJ, nid, _O_KEY, used, None, 0))
            if b == 0x7D and self._obj_can_close(node, used):  # }
                return self._value_done(base)
        return None

    def _arr(self, state: State, top: Frame, b: int) -> State | None:
        _, nid, phase, count, ws = top
        base = state[:-1]
        if b in _WS:
            return (*base, (_ARR, nid, phase, count, ws + 1)) if ws < self.max_ws else None
        node = self.nodes[nid]
        if b == 0x5D:  # ]
            return self._value_done(base)
        if phase == _A_FIRST:
            if node.max_items == 0:
                return None
            return self.step((*base, (_ARR, nid, _A_VALUE, count, 0), (_VALUE, node.items, self.max_ws)), b)
        if phase == _A_AFTER and b == 0x2C and (node.max_items < 0 or count < node.max_items):
            return (*base, (_ARR, nid, _A_VALUE, count, 0), (_VALUE, node.items, 0))
        return None

    def _str(self, state: State, top: Frame, b: int) -> State | None:
        _, u8, esc, left = top
        base = state[:-1]
        if u8 != 0:
            nu = _utf8(u8, b)
            return None if nu is None else (*base, (_STR, nu, _E_NONE, left))
        if esc == _E_NONE:
            if b == _QUOTE:
                return self._value_done(base)
            if b < 0x20 or left == 0:
                return None
            left = left - 1 if left > 0 else left
            if b == _BACKSLASH:
                return (*base, (_STR, 0, _E_BS, left))
            nu = _utf8(0, b)
            return None if nu is None else (*base, (_STR, nu, _E_NONE, left))
        nxt = self._escape(esc, b)
        return None if nxt is None else (*base, (_STR, 0, nxt, left))

    @staticmethod
    def _escape(esc: int, b: int) -> int | None:
        if esc == _E_BS:
            if b in _SIMPLE_ESC:
                return _E_NONE
            return _E_U1 if b == 0x75 else None
        if esc == _E_PL_BS:
            return _E_PL_U if b == _BACKSLASH else None
        if esc == _E_PL_U:
            return _E_PL_D if b == 0x75 else None
        if b not in _HEX:
            return None
        c = b | 0x20  # lower-case hex letter
        if esc == _E_U1:
            return _E_U2D if c == 0x64 else _E_U2
        if esc == _E_U2:
            return _E_U3
        if esc == _E_U2D:
            if b <= 0x37 and b in _DIGITS:  # 0-7: not a surrogate
                return _E_U3
            return _E_H3 if c in (0x38, 0x39, 0x61, 0x62) else None  # 8-b: high surrogate; c-f: lone low
        if esc == _E_U3:
            return _E_U4
        if esc == _E_U4:
            return _E_NONE
        if esc == _E_H3:
            return _E_H4
        if esc == _E_H4:
            return _E_PL_BS
        if esc == _E_PL_D:
            return _E_PL_C if c == 0x64 else None
        if esc == _E_PL_C:
            return _E_U3 if c in (0x63, 0x64, 0x65, 0x66) else None
        return None

    def _num(self, state: State, top: Frame, b: int) -> State | None:
        _, phase, integer, digits = top
        base = state[:-1]
        if b in _DIGITS:
            if phase == _N_MINUS:
                return (*base, (_NUM, _N_ZERO if b == 0x30 else _N_INT, integer, 1))
            if phase in (_N_INT, _N_FRAC, _N_EXP):
                limit = _MAX_EXP_DIGITS if phase == _N_EXP else _MAX_DIGITS
                return (*base, (_NUM, phase, integer, digits + 1)) if digits < limit else None
            if phase in (_N_DOT, _N_E, _N_ESIGN):
                return (*base, (_NUM, _N_FRAC if phase == _N_DOT else _N_EXP, integer, 1))
            return None  # a leading zero takes no more digits
        if b == 0x2E and phase in (_N_ZERO, _N_INT) and not integer:  # .
            return (*base, (_NUM, _N_DOT, integer, 0))
        if b in (0x65, 0x45) and phase in (_N_ZERO, _N_INT, _N_FRAC) and not integer:  # e E
            return (*base, (_NUM, _N_E, integer, 0))
        if b in (0x2B, 0x2D) and phase == _N_E:  # + -
            return (*base, (_NUM, _N_ESIGN, integer, 0))
        if phase in _N_DONE:
            return self.step(self._value_done(base), b)
        return None

    def _q3_call(self, state: State, top: Frame, b: int) -> State | None:
        return self.step((*state[:-1], (_CHOICE, self._head_choice(), b"")), b)

    _x_call = _q3_call

    def _complete(self, state: State, top: Frame, b: int) -> State | None:
        if not self.parallel:
            return None
        return self.step((*state[:-1], (_CHOICE, self._next_call, b"")), b)

    def _x_params(self, state: State, top: Frame, b: int) -> State | None:
        _, ti, used = top
        return self.step((*state[:-1], (_CHOICE, self._x_param_choice(ti, used), b"")), b)

    def _x_key(self, state: State, top: Frame, b: int) -> State | None:
        _, ti, used, key, u8 = top
        base = state[:-1]
        if b == 0x3E:  # >
            if u8 != 0 or not key:
                return None
            name = key.decode("utf-8")
            if name in used and len(key) < _X_KEY_MAX:  # (a repeat at the length cap: no dead end)
                return None
            return (*base, (_CHOICE, self._lit(b"\n", ("xparam", ti, used, name)), b""))
        if b in _X_BAD_KEY or (u8 == 0 and len(key) >= _X_KEY_MAX):
            return None
        nu = _utf8(u8, b)
        return None if nu is None else (*base, (_X_KEY, ti, used, key + _BYTE[b], nu))

    def _x_text(self, state: State, top: Frame, b: int) -> State | None:
        _, ti, used, pend, u8, left = top
        base = state[:-1]
        if u8 != 0:
            nu = _utf8(u8, b)
            return None if nu is None else (*base, (_X_TEXT, ti, used, b"", nu, left))
        if b >= 0x80:
            nu = _utf8(0, b)
            if nu is None or left == 0:
                return None
            return (*base, (_X_TEXT, ti, used, b"", nu, left - 1 if left > 0 else left))
        new = pend + _BYTE[b]
        while new not in _PEND:
            new = new[1:]
        if new == _PARAM_CLOSE:
            return (*base, (_CHOICE, self._lit(b"\n", ("xparams", ti, used)), b""))
        if new == _BARE_CLOSE:
            return None
        if left == 0:  # out of characters: only a step further into the closing "\n</parameter>"
            if not (_PARAM_CLOSE.startswith(new) and len(new) > _close_progress(pend)):
                return None
        elif left > 0:
            left -= 1
        return (*base, (_X_TEXT, ti, used, new, 0, left))
