"""The scripted replies of `eval swe --scripted`: the reference patch applied through the client's
own tools, one model request at a time, with the benchmark-only forced-output field.

Contract: `prompts(inst, turns)` are the task's user turns (the paper's W2: the issue text, then
"run the whole test suite again", then "summarise your change"), the first `turns` of them.
`plans(inst, workdir, turns)` maps each prompt to its steps: turn 1 reads every file the patch
touches, applies each edit, runs the task's test files and answers; turn 2 runs the whole suite
and answers; turn 3 shows `git diff` and answers. `TaskScript(workdir, family, plans)` answers a
normalised request as `evals.traces.script.Script` does (which prompt is current, how many tool
results follow it; a request without tools or without a known prompt is a side request) and picks
the tool by the request's own tool list (an Edit tool when the client has one, else its shell).
Clients that end a task with a command (mini-swe-agent: a first output line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`) answer with that command.
"""

from __future__ import annotations

import shlex

from evals.traces.script import Call, Reply, Script, Step
from freetoken_agent.eval.swe.tasks import Instance, test_command
from freetoken_agent.service import ChatRequest

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FOLLOW_UPS = ("Run the whole test suite once more and tell me whether everything passes.",
              "Summarise your change in one or two sentences.")


def prompts(inst: Instance, turns: int) -> list[str]:
    return [inst.problem_statement, *FOLLOW_UPS][:max(1, min(turns, 3))]


def plans(inst: Instance, turns: int) -> dict[str, list[Step]]:
    ps = prompts(inst, turns)
    touched = list(dict.fromkeys(p for p, _, _ in inst.edits))
    first: list[Step] = [("read", p) for p in touched]
    first += [("edit", p, old, new) if old else ("write", p, new) for p, old, new in inst.edits]
    first += [("run", test_command(inst)), ("answer", f"Fixed {', '.join(touched)}; the tests pass.")]
    out: dict[str, list[Step]] = {ps[0]: first}
    if len(ps) > 1:
        out[ps[1]] = [("run", test_command(inst, all_tests=True)), ("answer", "The whole suite passes.")]
    if len(ps) > 2:
        out[ps[2]] = [("run", "git diff --stat"), ("answer", f"I changed {', '.join(touched)} to fix the issue.")]
    return out


class TaskScript(Script):
    def __init__(self, workdir: str, family: str, task_plans: dict[str, list[Step]]) -> None:
        super().__init__(workdir, family)
        self.prompts = list(task_plans)
        self.plans = task_plans

    def reply(self, req: ChatRequest) -> Reply:
        pos = self.position(req)
        if pos is None:
            return Reply(reasoning="A short title is enough.", content="Fix the issue", side=True)
        k, n = pos
        steps = self.plans[self.prompts[k]]
        step = steps[min(n, len(steps) - 1)]
        thought = {"read": "I should look at {0} first.", "edit": "I will change {0} with the edit tool.",
                   "write": "I will write {0}.", "run": "Now I run `{0}` to check.",
                   "answer": "The work is done; I can report back."}[step[0]].format(*step[1:])
        if step[0] == "answer":
            if any(SUBMIT in m.content for m in req.messages if m.role in ("system", "user")):
                return Reply(reasoning=thought, calls=[self._shell(self._tools(req), self._shell_name(req),
                                                                   f"echo {SUBMIT}")])
            return Reply(reasoning=thought, content=step[1])
        if step[0] == "write":
            code = f"import pathlib; pathlib.Path({step[1]!r}).write_text({step[2]!r})"
            return Reply(reasoning=thought, calls=[self._shell(self._tools(req), self._shell_name(req),
                                                               f"cd {self.workdir} && python3 -c {shlex.quote(code)}")])
        if step[0] == "run":
            step = ("run", f"cd {self.workdir} && {step[1]}")
        return Reply(reasoning=thought, calls=[self.call(req, step)])

    @staticmethod
    def _tools(req: ChatRequest) -> dict[str, dict[str, object]]:
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}

    def _shell_name(self, req: ChatRequest) -> str | None:
        tools = self._tools(req)
        return next((n for n in ("Bash", "bash", "exec", "exec_command", "shell") if n in tools), None)


__all__ = ["SUBMIT", "Call", "TaskScript", "plans", "prompts"]
