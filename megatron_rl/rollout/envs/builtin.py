"""The built-in environments: a calculator tool and answer-with-feedback.

* ``calculator``: the model may call ``calculator(expression)`` in the tokenizer's tool
  format; each call is answered with the value (a "tool" message), and the episode ends at
  the first turn without a tool call (the answer). Counts ``tool_calls``, ``tool_errors``
  (unknown tool, bad arguments, an expression that does not evaluate) and
  ``correct_tool_use`` (1 when a call first returns the reference answer).
* ``feedback``: the model answers; a wrong answer (the last ``\\boxed{}`` or number, compared
  with the reference as text) gets a user message ("Wrong, try again.") and another turn,
  until it is right or the turns run out. Counts ``retries``; ``retry_penalty`` is the
  reward added per wrong answer.

Expressions are evaluated from Python's parsed syntax tree with numbers, ``+ - * / // %``,
``**`` with a bounded exponent, and parentheses: never ``eval``.
"""

from __future__ import annotations

import ast
import operator

from megatron_rl.data.prompts import PromptRecord
from megatron_rl.rollout.envs.base import Environment, EnvStep, Messages, ModelTurn

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
"""The calculator's JSON Schema, as chat templates list tools."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_EXPRESSION_CHARS = 200


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate."""


def evaluate_expression(text: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring for what is allowed)."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {text!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed in an expression")


def format_number(value: int | float) -> str:
    """Integers (and floats with an integer value) without a decimal point, others as Python prints them."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


class CalculatorEnv(Environment):
    """Answers ``calculator`` tool calls until the model answers without one (see the module docstring)."""

    tools = [CALCULATOR_TOOL]

    def __init__(self) -> None:
        self.answer = ""
        self.used_correctly = False

    def reset(self, row: PromptRecord) -> Messages | None:
        self.answer = row.ground_truth.strip()
        return None

    def step(self, turn: ModelTurn) -> EnvStep:
        if not turn.tool_calls:
            return EnvStep(done=True, metrics={"tool_calls": 0, "tool_errors": 0, "correct_tool_use": 0})
        results, errors, correct = [], 0, 0
        for call in turn.tool_calls:
            text, ok = self._run(call.name, call.arguments)
            errors += not ok
            if ok and text == self.answer and not self.used_correctly:
                self.used_correctly, correct = True, 1
            results.append({"role": "tool", "content": text})
        return EnvStep(observation=results, metrics={"tool_calls": len(turn.tool_calls), "tool_errors": errors,
                                                     "correct_tool_use": correct})

    @staticmethod
    def _run(name: str, arguments: dict) -> tuple[str, bool]:
        """(the tool message's text, whether the call succeeded)."""
        if name != "calculator":
            return f"error: unknown tool {name!r}", False
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: the argument 'expression' must be a string", False
        try:
            return format_number(evaluate_expression(expression)), True
        except CalculatorError as err:
            return f"error: {err}", False


class FeedbackEnv(Environment):
    """Answer, hear "wrong, try again", answer again (see the module docstring).

    Args:
        feedback: the user message after a wrong answer.
        retry_penalty: reward added for each wrong answer (e.g. -0.1).
    """

    def __init__(self, feedback: str = "Wrong, try again.", retry_penalty: float = 0.0) -> None:
        from megatron_rl.rewards.builtin import extract_final_answer

        self._extract = extract_final_answer
        self.feedback, self.retry_penalty = feedback, float(retry_penalty)
        self.answer = ""

    def reset(self, row: PromptRecord) -> Messages | None:
        self.answer = row.ground_truth.strip()
        return None

    def step(self, turn: ModelTurn) -> EnvStep:
        given = self._extract(turn.text)
        if given is not None and given.strip() == self.answer:
            return EnvStep(done=True, metrics={"retries": 0})
        return EnvStep(observation=[{"role": "user", "content": self.feedback}], reward=self.retry_penalty,
                       metrics={"retries": 1})
