"""A benchmark's token lengths against the context of the model it runs on.

Each benchmark's length flags default to None, meaning its recipe's lengths (sized for the GPU models of
BENCHMARKS.md). Where those do not fit the model's max_model_len (the bundled model has 512 tokens), the lengths
left to the recipe are scaled down together until they fit, and the run says so; a length given on the command
line is used as given, and one that cannot fit is refused naming its flag, before anything runs.
"""

import sys
from collections.abc import Callable

Length = int | list[int]
# Halvings of the scale factor's interval: enough to land on whole tokens for any context.
_STEPS = 60


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fit_lengths(ns, recipe: dict[str, Length], need: Callable[[dict[str, Length]], int], context: int,
                bench: str, floors: dict[str, int] | None = None) -> str | None:
    """Set every length of `recipe` that `ns` leaves None, so that need(lengths) <= context: the recipe's own
    if they fit, else all of them scaled by one factor (each at least its floor, default 1). Returns the note
    printed to stderr when they were scaled, else None. ValueError, naming the flags given, when no lengths fit."""
    floors = floors or {}
    given = {name: getattr(ns, name) for name in recipe if getattr(ns, name) is not None}
    free = {name: value for name, value in recipe.items() if name not in given}
    lengths = given | free
    if need(lengths) <= context:
        _set(ns, lengths)
        return None

    def scaled(factor: float) -> dict[str, Length]:
        return given | {name: _scale(value, factor, floors.get(name, 1)) for name, value in free.items()}

    if need(scaled(0.0)) > context:
        named = _flags(given) if given else _flags(scaled(0.0))
        raise ValueError(f"{named}: need {need(scaled(0.0))} tokens of context, over the model's max_model_len "
                         f"{context} (bench {bench}; --max-model-len or a model with a longer context)")
    # The largest factor that fits (need grows with every length): the lengths keep the recipe's proportions.
    low, high = 0.0, 1.0
    for _ in range(_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if need(scaled(mid)) <= context else (low, mid)
    _set(ns, scaled(low))
    note = (f"bench {bench}: the recipe's lengths ({_flags(free)}) need {need(lengths)} tokens of context, over the "
            f"model's max_model_len {context}: scaled by {low:.3g} to {_flags(vars(ns), free)}")
    print(note, file=sys.stderr, flush=True)
    return note


def _scale(value: Length, factor: float, floor: int) -> Length:
    if isinstance(value, list):
        return [max(floor, int(v * factor)) for v in value]
    return max(floor, int(value * factor))


def _flags(lengths: dict[str, Length], only: dict | None = None) -> str:
    names = [name for name in lengths if only is None or name in only]
    return ", ".join(f"{flag(name)} {' '.join(map(str, _as_list(lengths[name])))}" for name in names)


def _as_list(value: Length) -> list[int]:
    return value if isinstance(value, list) else [value]


def _set(ns, lengths: dict[str, Length]) -> None:
    for name, value in lengths.items():
        setattr(ns, name, value)
