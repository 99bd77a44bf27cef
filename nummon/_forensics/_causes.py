"""The mathematical cause of a non-finite result, from the operator and its (finite) inputs, with
the numbers that show it and a one-line remedy. Runs only on the few ops that failed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "WEIGHT_SCALE",
    "Cause",
    "classify",
    "classify_backward",
    "classify_inf_arithmetic",
    "magnitude_cause",
    "op_base",
]

Cause = tuple[str, str, str]  # (cause, input_ranges, remedy)

_LOGS = {"log": "log", "log2": "log2", "log10": "log10", "log1p": "log1p"}
_DIVISIONS = {"div", "true_divide", "floor_divide", "remainder", "fmod"}
_EXPONENTIALS = {"exp": math.log, "exp2": math.log2, "expm1": math.log}
_HYPERBOLIC = {"sinh", "cosh"}
_CASTS = {"_to_copy", "to", "copy", "copy_", "_to_dtype", "type_as", "clone"}
# Forward ops whose derivative is infinite or undefined at a finite point (sqrt at 0, the norm
# of a zero vector, ...): a non-finite gradient through them is an invalid operation.
_SINGULAR_GRADIENT = {
    "sqrt": "d/dx sqrt(x) = 1/(2*sqrt(x)) is infinite at x = 0",
    "rsqrt": "d/dx x^-1/2 is infinite at x = 0",
    "pow": "d/dx x^p = p*x^(p-1) is infinite at x = 0 for p < 1",
    "norm": "the gradient x/|x| of a norm is undefined for a zero vector",
    "linalg_vector_norm": "the gradient x/|x| of a norm is undefined for a zero vector",
    "_cdist_forward": "the gradient of a distance is undefined where two points coincide",
    "std": "the gradient of std is infinite where the variance is 0",
    "std_mean": "the gradient of std is infinite where the variance is 0",
    "acos": "d/dx acos(x) is infinite at |x| = 1",
    "asin": "d/dx asin(x) is infinite at |x| = 1",
    "atanh": "d/dx atanh(x) is infinite at |x| = 1",
    "acosh": "d/dx acosh(x) is infinite at x = 1",
}

_REMEDIES = {
    "log_of_zero": "use log_softmax / logsumexp instead of log(softmax(...)), or add an epsilon (log(x + eps), x.clamp_min(eps))",
    "division_by_zero": "add an epsilon to the denominator (x / (d + eps), or d.clamp_min(eps))",
    "exp_overflow": "clamp before exp (x.clamp(max=...)) or stay in log space (logsumexp, log_softmax)",
    "lowp_overflow": "scale the inputs down (normalise, smaller init or LR) or run this op in float32 (autocast(enabled=False))",
    "cast_overflow": "the value exceeds the target dtype's range: normalise before the cast or keep float32",
    "overflow": "scale the inputs down (normalise, lower the LR, clip gradients) or compute in a wider dtype",
    "sqrt_domain": "clamp to >= 0 before sqrt (x.clamp_min(0)), or sqrt(x + eps)",
    "log_domain": "clamp to > 0 before log (x.clamp_min(eps))",
    "singular_gradient": "keep the input away from the singular point: sqrt(x + eps), or torch.linalg.vector_norm (its gradient at 0 is 0)",
    "inf_arithmetic": "fill with a large finite value (torch.finfo(dtype).min) instead of ±inf, and make sure no row is fully masked",
    "invalid_operation": "keep the inputs inside the operator's domain (clamp them) or guard with torch.where on the inputs, not the output",
}


#: a weight above this magnitude is no trained weight's scale: updates made it (the learning rate)
WEIGHT_SCALE = 1e3
#: the remedy of an overflow, by the operand that carries the magnitude
_MAGNITUDE_REMEDIES = {
    "weights": "lower the learning rate, clip gradients (clip_grad_norm_) or add weight decay: the updates grew the weights",
    "data": "normalise the inputs: the batch itself holds values this large",
    "gradients": "clip gradients (clip_grad_norm_) or lower the learning rate; in float16 use a loss scaler (GradScaler): the gradients grew in the backward while the weights stayed in range",
    "activations": "normalise between layers (LayerNorm, BatchNorm) or scale the residual branches down: the activations grew through earlier layers while the weights stayed in range",
}


def _blame(
    own: tuple[str, float] | None, largest: tuple[str, float] | None, data_max: float, backward: bool = False
) -> tuple[str, str]:
    """(the words, the role) of the operand that carries an overflow's magnitude."""
    if own is not None and own[1] >= WEIGHT_SCALE:  # this op's own weight
        return f"the weights carry the magnitude: {own[0]} reached max |w| {_num(own[1])}", "weights"
    if largest is not None and largest[1] >= WEIGHT_SCALE:  # an earlier layer's
        return f"the weights carry the magnitude: {largest[0]} reached max |w| {_num(largest[1])}", "weights"
    if data_max >= WEIGHT_SCALE:
        return f"the data carries the magnitude: the batch reaches max |x| {_num(data_max)}", "data"
    top = f" (largest weight {largest[0]} max |w| {_num(largest[1])})" if largest is not None else ""
    if backward:
        return f"the gradients carry the magnitude, the weights are in range{top}", "gradients"
    return f"the activations carry the magnitude, the weights are in range{top}", "activations"


def magnitude_cause(
    name: str,
    operands: Sequence[Any],
    dtype: torch.dtype,
    roles: list[tuple[str, str]],
    largest: tuple[str, float] | None,
    backward: bool = False,
) -> Cause:
    """An overflow of a sum or product of finite operands, blamed on the operand that carries the
    magnitude: the weights (`largest`: the model's largest parameter, (name, max |w|), at or above
    `WEIGHT_SCALE`), else the data, else the activations (in the `backward`: the gradients).
    `roles`: each floating operand's (role, label), role one of "weights", "data", "activations"."""
    tensors = _float_tensors(operands)
    shown: list[str] = []
    data_max, own = 0.0, None
    for tensor, (role, label) in zip(tensors, roles):
        span = _span([tensor])
        if span is None:
            continue
        top = max(abs(span[0]), abs(span[1]))
        shown.append(f"{label} max |x| {_num(top)}")
        data_max = max(data_max, top) if role == "data" else data_max
        if role == "weights" and (own is None or top > own[1]):
            own = (label.removeprefix("parameter "), top)
    limit = f"{_dtype(dtype)} max is {_num(torch.finfo(dtype).max)}"
    blame, role = _blame(own, largest, data_max, backward)
    remedy = _MAGNITUDE_REMEDIES[role]
    if dtype in (torch.float16, torch.bfloat16):
        remedy += ", or run this op in float32 (autocast(enabled=False))"
    return ("overflow", f"{blame}; the operands of {name}: {', '.join(shown)}; {limit}", remedy)


def op_base(op: str) -> str:
    """'aten::exp_' -> 'exp' (the overload packet without namespace and in-place suffix)."""
    name = op.split("::")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _num(x: float) -> str:
    return f"{x:.4g}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _float_tensors(operands: Sequence[Any]) -> list[torch.Tensor]:
    return [t for t in operands if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _span(operands: Sequence[Any]) -> tuple[float, float] | None:
    """(min, max) over the finite values of the floating tensor operands."""
    lows, highs = [], []
    for tensor in _float_tensors(operands):
        values = tensor.detach().real.float().flatten()
        values = values[torch.isfinite(values)]
        if values.numel():
            low, high = torch.aminmax(values)
            lows.append(float(low))
            highs.append(float(high))
    return (min(lows), max(highs)) if lows else None


def _count(condition: Any) -> int:
    return int(condition.sum()) if isinstance(condition, torch.Tensor) else int(bool(condition))


def _overflow_text(name: str, operands: Sequence[Any], dtype: torch.dtype) -> str:
    span = _span(operands)
    limit = torch.finfo(dtype).max
    if span is None:
        return f"{name} exceeded {_dtype(dtype)}'s max {_num(limit)}"
    largest = max(abs(span[0]), abs(span[1]))
    return f"inputs to {name} span [{_num(span[0])}, {_num(span[1])}] (max |x| {_num(largest)}); {_dtype(dtype)} max is {_num(limit)}"


def _log_cause(name: str, x: Any) -> Cause | None:
    """A logarithm's input at its pole (log of zero) or below it; None when neither."""
    if name not in _LOGS or not isinstance(x, torch.Tensor):
        return None
    pole = -1.0 if name == "log1p" else 0.0
    at_pole, below = _count(x == pole), _count(x < pole)
    if at_pole:
        return (
            "log_of_zero",
            f"{at_pole} of {x.numel()} inputs to {name} are exactly {_num(pole)} (min input {_num(float(x.min()))})",
            _REMEDIES["log_of_zero"],
        )
    if below:
        return (
            "invalid_operation",
            f"{below} of {x.numel()} inputs to {name} are below {_num(pole)} (min {_num(float(x.min()))})",
            _REMEDIES["log_domain"],
        )
    return None


def _division_cause(name: str, operands: Sequence[Any], dtype: torch.dtype) -> Cause | None:
    """A division by zero (a division's denominator, a reciprocal's input), or a division's overflow;
    None for an op that divides nothing."""
    x = operands[0] if operands else None
    if name in _DIVISIONS and len(operands) > 1:
        denominator = operands[1]
        zeros = _count(denominator == 0)
        if zeros:
            x = operands[0]  # there are two operands: the numerator is one
            numerator = _span([x]) if isinstance(x, torch.Tensor) else (float(x), float(x))
            around = f" (numerator in [{_num(numerator[0])}, {_num(numerator[1])}])" if numerator else ""
            return (
                "division_by_zero",
                f"{zeros} zero(s) in the denominator of {name}{around}",
                _REMEDIES["division_by_zero"],
            )
        return ("overflow", _overflow_text(name, operands, dtype), _REMEDIES["overflow"])
    if name in {"reciprocal", "rsqrt"} and isinstance(x, torch.Tensor):
        zeros = _count(x == 0)
        if zeros:
            return (
                "division_by_zero",
                f"{zeros} of {x.numel()} inputs to {name} are exactly 0",
                _REMEDIES["division_by_zero"],
            )
    return None


def classify(op: str, operands: Sequence[Any], out: torch.Tensor) -> Cause:
    """Cause of `out` (non-finite) from finite `operands` (the op's args then kwargs values)."""
    name = op_base(op)
    dtype = out.dtype if out.is_floating_point() else torch.float32
    x = operands[0] if operands else None
    cause = _log_cause(name, x) or _division_cause(name, operands, dtype)
    if cause is not None:
        return cause
    if name in {"sqrt", "rsqrt"} and isinstance(x, torch.Tensor) and _count(x < 0):
        return (
            "invalid_operation",
            f"{_count(x < 0)} of {x.numel()} inputs to {name} are negative (min {_num(float(x.min()))})",
            _REMEDIES["sqrt_domain"],
        )
    if name == "pow" and len(operands) > 1:
        return _classify_pow(operands[0], operands[1], dtype)
    if name in {"acos", "asin"} and isinstance(x, torch.Tensor) and _count(x.abs() > 1):
        return (
            "invalid_operation",
            f"{_count(x.abs() > 1)} inputs to {name} lie outside [-1, 1]",
            _REMEDIES["invalid_operation"],
        )
    if name in _EXPONENTIALS or name in _HYPERBOLIC:
        log_of = _EXPONENTIALS.get(name, math.log)
        threshold = log_of(torch.finfo(dtype).max) + (math.log(2) if name in _HYPERBOLIC else 0.0)
        span = _span(operands)
        top = _num(span[1]) if span else "?"
        return (
            "overflow",
            f"max input {top} to {name}; {_dtype(dtype)} overflows above {threshold:.1f}",
            _REMEDIES["exp_overflow"],
        )
    if name in _CASTS:
        return ("overflow", _overflow_text(f"the cast to {_dtype(dtype)}", operands, dtype), _REMEDIES["cast_overflow"])
    nan_only = not bool(torch.isinf(out).any())
    if nan_only and name in {"sqrt", "log", "acos", "asin", "acosh", "atanh", "lgamma", "digamma", "polygamma"}:
        return ("invalid_operation", f"finite inputs outside the domain of {name}", _REMEDIES["invalid_operation"])
    # Sums, products, matmuls, convolutions: from finite inputs even a NaN needs an inf in between.
    remedy = _REMEDIES["lowp_overflow"] if dtype in (torch.float16, torch.bfloat16) else _REMEDIES["overflow"]
    return ("overflow", _overflow_text(name, operands, dtype), remedy)


def _classify_pow(base: Any, exponent: Any, dtype: torch.dtype) -> Cause:
    base_t = torch.as_tensor(base, dtype=torch.float64)
    exp_t = torch.as_tensor(exponent, dtype=torch.float64)
    zero_to_negative = _count((base_t == 0) & (exp_t < 0))
    if zero_to_negative:
        return (
            "division_by_zero",
            f"{zero_to_negative} zero base(s) raised to a negative power",
            _REMEDIES["division_by_zero"],
        )
    negative_fractional = _count((base_t < 0) & (exp_t != torch.round(exp_t)))
    if negative_fractional:
        return (
            "invalid_operation",
            f"{negative_fractional} negative base(s) raised to a fractional power",
            _REMEDIES["invalid_operation"],
        )
    return (
        "overflow",
        _overflow_text("pow", [b for b in (base, exponent) if isinstance(b, torch.Tensor)], dtype),
        _REMEDIES["overflow"],
    )


def classify_backward(op: str, forward_op: str | None, operands: Sequence[Any], out: torch.Tensor) -> Cause:
    """A backward op's cause; a gradient that blows up through a forward op with a singular
    derivative (sqrt at 0, ...) is an invalid operation of that forward op."""
    cause, ranges, remedy = classify(op, operands, out)
    forward_name = op_base(forward_op) if forward_op else None
    if forward_name in _SINGULAR_GRADIENT and cause in ("division_by_zero", "invalid_operation"):
        detail = f"{_SINGULAR_GRADIENT[forward_name]}; the backward met it as: {ranges}"
        return ("invalid_operation", detail, _REMEDIES["singular_gradient"])
    return cause, ranges, remedy


def classify_inf_arithmetic(op: str, operands: Sequence[Any]) -> Cause:
    """NaN made from deliberate infinities (an -inf mask, a constant inf): inf - inf, 0 * inf,
    inf / inf, or a softmax over a row that is entirely -inf."""
    name = op_base(op)
    infs = sum(_count(torch.isinf(t)) for t in _float_tensors(operands))
    if name in {"_softmax", "_log_softmax", "softmax", "log_softmax", "logsumexp"}:
        what = f"a row of the input to {name} is entirely -inf (inf - inf inside it; a fully masked row?)"
    elif name in {"sub", "add", "rsub"}:
        what = f"inf - inf in {name} ({infs} infinite input value(s))"
    elif name in {"mul", "mm", "matmul", "bmm", "addmm", "baddbmm", "linear"}:
        what = f"0 * inf in {name} ({infs} infinite input value(s))"
    else:
        what = f"arithmetic on {infs} infinite input value(s) in {name} produced NaN"
    return ("invalid_operation", what, _REMEDIES["inf_arithmetic"])
