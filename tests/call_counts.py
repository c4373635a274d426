"""Counting the calls a test expects an engine to make (CUDA graph replays, draft steps), by wrapping a method."""


def count_calls(obj, name: str, counter: dict, key: str) -> None:
    """Replace obj.name by a wrapper that adds one to counter[key] per call."""
    original = getattr(obj, name)

    def counted(*args):
        counter[key] += 1
        return original(*args)

    setattr(obj, name, counted)
