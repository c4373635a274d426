"""What a speculating engine's proposer drafts, recorded proposal by proposal (tests that compare the drafts of two
engines: tensor-parallel sizes, the CPU tier)."""

from nanoserve import LLM


def record_drafts(llm: LLM) -> list[list[list[int]]]:
    """A list that each later proposal of llm's proposer appends its drafts to (one list per sequence)."""
    drafts, propose = [], llm.engine.proposer.propose

    def recording(rows, caps):
        out = propose(rows, caps)
        drafts.append([list(d) for d in out])
        return out
    llm.engine.proposer.propose = recording
    return drafts
