"""A safe calculator for model tool calls: arithmetic and `"word".count("x")`, by walking the AST.

Nothing is ever passed to eval/exec/compile. Accepted:
  - int and float literals, unary + and -, binary + - * / // % and `**` with an integer exponent in
    [-64, 64] (so `9**9**9` is rejected before anything is computed), parentheses;
  - `"word".count("x")` with a string-literal receiver and one string-literal argument (an int that can
    take part in arithmetic);
  - thousands separators in expressions without string literals: "1,234*2" is read as 1234*2; any other
    comma (such as "1,2") makes a tuple, which is rejected.
Limits: 200 characters, 256 AST nodes, |value| <= 10**18 at every step (numerators and denominators of
exact fractions too), 50 ms of wall clock. Anything else (names, other calls or attributes, subscripts,
lambdas, comprehensions, f-strings, bytes, booleans, complex numbers, inf/nan) gives None, as does
division by zero.

Results: ints as str(int); `/` on ints is exact (a Fraction), so 10**17/2 is "50000000000000000";
non-integral results are rounded to 6 decimals with trailing zeros stripped ("0.333333", "2.5");
integral floats print as ints ("4").
"""

import ast
import math
import operator
import re
import time
from fractions import Fraction

MAX_LEN = 200
MAX_NODES = 256
MAX_ABS = 10**18
MAX_EXPONENT = 64
TIME_LIMIT_S = 0.05

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

Number = int | float | Fraction


class _Reject(Exception):
    pass


def calculator(expr: str) -> str | None:
    """Evaluate a tool-call expression; the result as a string, or None if it is not allowed."""
    if not isinstance(expr, str) or len(expr) > MAX_LEN:
        return None
    expr = expr.strip()
    if "'" not in expr and '"' not in expr:
        expr = _THOUSANDS_COMMA.sub("", expr)
    try:
        tree = ast.parse(expr, mode="eval")
        if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
            return None
        value = _Evaluator(time.perf_counter() + TIME_LIMIT_S).eval(tree.body)
    except (_Reject, SyntaxError, ValueError, TypeError, ArithmeticError, RecursionError, MemoryError):
        return None
    return _format(value)


class _Evaluator:
    def __init__(self, deadline: float):
        self.deadline = deadline

    def eval(self, node: ast.AST) -> Number:
        if time.perf_counter() > self.deadline:
            raise _Reject
        match node:
            # bool is a subclass of int: `True` must not count as a number.
            case ast.Constant(value=int() | float() as v) if not isinstance(v, bool):
                return _check(v)
            case ast.UnaryOp(op=ast.USub() | ast.UAdd() as op, operand=operand):
                v = self.eval(operand)
                return _check(-v if isinstance(op, ast.USub) else v)
            case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINOPS:
                a, b = self.eval(left), self.eval(right)
                if isinstance(op, ast.Pow):
                    # Only small integer exponents: the result's size is bounded before it is computed.
                    if not isinstance(b, int) or abs(b) > MAX_EXPONENT:
                        raise _Reject
                exact = (int, Fraction)
                if isinstance(op, ast.Div) and isinstance(a, exact) and isinstance(b, exact):
                    return _check(Fraction(a) / Fraction(b))  # exact, unlike float division
                return _check(_BINOPS[type(op)](a, b))
            case ast.Call(
                func=ast.Attribute(value=ast.Constant(value=str() as s), attr="count"),
                args=[ast.Constant(value=str() as sub)],
                keywords=[],
            ):
                return s.count(sub)
        raise _Reject


def _check(v: Number) -> Number:
    if isinstance(v, Fraction):
        if abs(v.numerator) > MAX_ABS or v.denominator > MAX_ABS:
            raise _Reject
        return v.numerator if v.denominator == 1 else v
    if (isinstance(v, float) and not math.isfinite(v)) or abs(v) > MAX_ABS:
        raise _Reject
    return v


def _format(v: Number) -> str:
    if isinstance(v, int):
        return str(v)
    if isinstance(v, Fraction):
        v = float(v)
    if v.is_integer():
        return str(int(v))
    s = f"{v:.6f}".rstrip("0").rstrip(".")
    return "0" if s == "-0" else s
