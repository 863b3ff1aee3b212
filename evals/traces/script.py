"""The scripted coding task that capture runs, and the model-format text of each scripted reply.

Contract:
- `TASK_FILES` is the tiny repository the client works in (a bug in `calc.py`, a plain-Python test).
- `PROMPTS` are the user turns, in order; `prompts(variant)` adds the variant's extra turns (a
  first turn of large tool outputs, `BIG_FILES`, and a last one) and `PLANS` maps each prompt to
  its steps.
- `Script(workdir, family, variant).reply(req)` takes the normalised `ChatRequest` of one model
  request and returns a `Reply` (reasoning, content, tool calls with arguments) chosen from the
  request alone: which user prompt is current (the last of `PROMPTS` found in a user message) and
  how many tool results follow it. A request without tools, or without a known prompt, is a side
  request (title generation and the like) and gets a short text answer. Tool names and argument
  names come from the request's tool list (Claude Code `Read/Edit/Bash`, OpenCode
  `read/edit/bash`, OpenClaw `read/edit/exec`, Codex `exec_command` only), so one plan serves
  every client.
- `render(reply, family, thinking)` is the exact text the model would emit for the reply (Qwen3
  JSON tool calls, Qwen3.5 XML tool calls, or gpt-oss harmony messages: `render_harmony`), starting where the chat template's generation prompt
  ends, and laid out as the template re-renders it, so the echoed turn tokenises the same.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.service import ChatRequest

TASK_FILES = {
    "calc.py": 'def add(a, b):\n    """Return the sum of a and b."""\n    return a - b\n',
    "test_calc.py": "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint(\"ok\")\n",
    "README.md": "# calc\n\nA tiny calculator. Run `python3 test_calc.py` to test it.\n",
}
PROMPTS = [
    "The test in test_calc.py fails. Fix the bug in calc.py, then run `python3 test_calc.py`.",
    "Now add a function mul(a, b) to calc.py and a check for it in test_calc.py, then run the test again.",
]
# Variants with history edits start with a turn of large tool outputs, so that two later turns
# push them out of the client's protected tail and past its pruning thresholds (OpenCode: the
# newest 40k estimated tokens (chars / 4) of tool output in turns older than the last two are kept,
# older ones are cleared once they add up to 20k: seven 50 KB outputs; OpenClaw: results over 4000
# characters are trimmed once the context is 30% full). The logs are long separator lines: many characters
# (what the clients estimate) but few tokens (what fits the demo model's 32k context).
BIG_FILES = tuple(f"logs/run{i}.log" for i in range(1, 8))
BIG_PROMPT = "Print each of the seven files in logs/ with cat, one command per file, then say done."
FINAL_PROMPT = "Run the tests one last time and tell me if everything passes."


def prompts(variant: str | None) -> list[str]:
    return [BIG_PROMPT, *PROMPTS, FINAL_PROMPT] if variant else list(PROMPTS)


def big_file(index: int, lines: int = 50) -> str:
    """50,000 bytes (under OpenCode's 51200-byte tool-output cap) in ~1k tokens."""
    return "".join(f"{index}{i:03d} " + "=" * 994 + "\n" for i in range(lines))


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    side: bool = False  # a side request (title generation and the like), not a step of the task

    def to_json(self) -> dict[str, Any]:
        return {"side": self.side, "reasoning": self.reasoning, "content": self.content,
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in self.calls]}


# Abstract steps per prompt: ("read", path) | ("edit", path, old, new) | ("run", cmd) | ("answer", text)
Step = tuple[str, ...]
PLANS: dict[str, list[Step]] = {
    PROMPTS[0]: [
        ("read", "calc.py"), ("read", "test_calc.py"),
        ("edit", "calc.py", "    return a - b\n", "    return a + b\n"),
        ("run", "python3 test_calc.py"),
        ("answer", "Fixed: add() subtracted its arguments; it now returns a + b and test_calc.py prints ok.")],
    PROMPTS[1]: [
        ("edit", "calc.py", "    return a + b\n", "    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"),
        ("edit", "test_calc.py", "from calc import add\n", "from calc import add, mul\n\nassert mul(3, 4) == 12\n"),
        ("run", "python3 test_calc.py"),
        ("answer", "Added mul(a, b) with a check in test_calc.py; the test prints ok.")],
    BIG_PROMPT: [*(("run", f"cat {f}") for f in BIG_FILES), ("answer", "Done: seven run logs, 50 lines each.")],
    FINAL_PROMPT: [("run", "python3 test_calc.py"), ("answer", "Everything passes: test_calc.py prints ok.")],
}
PLAN = [PLANS[p] for p in PROMPTS]
THOUGHTS = {"read": "I should look at {0} first.", "edit": "I will change {0} with the edit tool.",
            "run": "Now I run `{0}` to check.", "answer": "The work is done; I can report back."}


def _names(req: ChatRequest) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}


def _props(schema: dict[str, Any]) -> set[str]:
    return set((schema.get("properties") or {}).keys())


class Script:
    def __init__(self, workdir: str, family: str, variant: str | None = None) -> None:
        self.workdir, self.family, self.prompts = workdir.rstrip("/"), family, prompts(variant)

    def position(self, req: ChatRequest) -> tuple[int, int] | None:
        """(prompt index, tool results after it) or None for a side request."""
        if not req.tools:
            return None
        found: tuple[int, int] | None = None
        for i, m in enumerate(req.messages):
            if m.role != "user":
                continue
            for k, p in enumerate(self.prompts):
                if p in m.content and (found is None or k >= found[0]):
                    found = (k, i)
        if found is None:
            return None
        k, at = found
        return k, sum(1 for m in req.messages[at + 1:] if m.role == "tool")

    def reply(self, req: ChatRequest) -> Reply:
        pos = self.position(req)
        if pos is None:
            return Reply(reasoning="A short title is enough.", content="Fix calc add bug", side=True)
        k, n = pos
        steps = PLANS[self.prompts[k]]
        step = steps[min(n, len(steps) - 1)]
        return Reply(reasoning=THOUGHTS[step[0]].format(*step[1:]),
                     content=step[1] if step[0] == "answer" else "",
                     calls=[] if step[0] == "answer" else [self.call(req, step)])

    def _abs(self, path: str) -> str:
        return f"{self.workdir}/{path}"

    def call(self, req: ChatRequest, step: Step) -> Call:
        tools = _names(req)
        kind = step[0]
        shell = next((n for n in ("Bash", "bash", "exec", "exec_command", "shell") if n in tools), None)
        if kind == "read":
            for name in ("Read", "read"):
                if name in tools:
                    props = _props(tools[name])
                    key = next(k for k in ("file_path", "filePath", "path") if k in props)
                    return Call(name, {key: self._abs(step[1])})
            return self._shell(tools, shell, f"cat {shlex.quote(step[1])}")
        if kind == "edit":
            _, path, old, new = step
            for name in ("Edit", "edit"):
                if name not in tools:
                    continue
                props = _props(tools[name])
                if "edits" in props:  # OpenClaw: a list of replacements
                    return Call(name, {"path": self._abs(path), "edits": [{"oldText": old, "newText": new}]})
                if "oldString" in props:  # OpenCode
                    return Call(name, {"filePath": self._abs(path), "oldString": old, "newString": new})
                if "old_string" in props:  # Claude Code
                    return Call(name, {"file_path": self._abs(path), "old_string": old, "new_string": new})
            code = (f"import pathlib; p = pathlib.Path({path!r}); "
                    f"p.write_text(p.read_text().replace({old!r}, {new!r}, 1))")
            return self._shell(tools, shell, f"python3 -c {shlex.quote(code)}")
        return self._shell(tools, shell, step[1])

    def _shell(self, tools: dict[str, dict[str, Any]], name: str | None, command: str) -> Call:
        if name is None:
            raise ValueError(f"the request offers no shell tool among {sorted(tools)}")
        props = _props(tools[name])
        key = "cmd" if "cmd" in props and "command" not in props else "command"
        args: dict[str, Any] = {key: command}
        if "workdir" in props:
            args["workdir"] = self.workdir
        if name == "Bash" and "description" in props:
            args["description"] = "Run a command"
        return Call(name, args)


def render_harmony(reply: Reply) -> str:
    """gpt-oss's harmony messages for `reply` after the generation prompt (`<|start|>assistant`):
    the reasoning on the analysis channel (gpt-oss always reasons; a low effort only shortens it),
    then the tool calls on the commentary channel (the content before them as a preamble), or
    else the content on the final channel, ending with `<|return|>`."""
    msgs = []
    if reply.reasoning.strip():
        msgs.append(f"<|channel|>analysis<|message|>{reply.reasoning.strip()}<|end|>")
    content = reply.content.strip()
    if reply.calls:
        if content:
            msgs.append(f"<|channel|>commentary<|message|>{content}<|end|>")
        msgs += [f" to=functions.{c.name}<|channel|>commentary <|constrain|>json<|message|>"
                 f"{json.dumps(c.arguments, ensure_ascii=False, separators=(',', ':'))}<|call|>" for c in reply.calls]
    else:
        msgs.append(f"<|channel|>final<|message|>{content}<|return|>")
    return "<|start|>assistant".join(msgs)


def render(reply: Reply, family: str, thinking: bool) -> str:
    """The model text for `reply`, starting right after the generation prompt."""
    if family == "gpt_oss":
        return render_harmony(reply)
    body = reply.content.strip()
    for i, c in enumerate(reply.calls):
        sep = "\n" if i else ("\n\n" if body else "")
        if family == "qwen3_5":
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                             f"\n</parameter>\n" for k, v in c.arguments.items())
            body += f"{sep}<tool_call>\n<function={c.name}>\n{params}</function>\n</tool_call>"
        else:
            obj = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            body += f"{sep}<tool_call>\n{obj}\n</tool_call>"
    if not thinking:
        return body
    reasoning = reply.reasoning.strip()
    if family == "qwen3_5":  # the generation prompt already opened the think block
        return f"{reasoning}\n</think>\n\n{body}"
    return f"<think>\n{reasoning}\n</think>\n\n{body}"
