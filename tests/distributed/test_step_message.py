"""StepInputs between ranks: what rank 0 sends is what the other ranks rebuild, every field, whichever path (shared
memory or gloo) carries the one int64 message."""

import numpy as np

from nanoserve.worker.step_inputs import LongContextRow, StepInputs


class Loopback:
    """A TensorParallelGroup's host messages, looped back in one process."""

    def __init__(self) -> None:
        self.messages = []

    def send_host(self, message: np.ndarray) -> None:
        self.messages.append(np.array(message, np.int64))

    def recv_host(self) -> np.ndarray:
        return self.messages.pop(0)


def test_every_field_survives_the_message():
    host = np.random.default_rng(0).integers(-5, 1000, 37)
    sent = StepInputs(
        host,
        num_tokens=7,
        num_seqs=3,
        width=4,
        num_pending=2,
        num_logit_rows=-1,
        max_seqlen_q=5,
        num_decodes=2,
        sample=True,
        local=True,
        block_copies=[(1, 2)],
        kv_swap_out=[(3, 4), (5, 6)],
        kv_swap_in=[(7, 8)],
        local_block_copies=[(14, 15), (16, 17)],
        prompt_logprob_rows=[(0, 3)],
        long_context=[LongContextRow(0, 5, 64, [9, 10], [11, 12, 13])],
        replica_call=42,
        temperatures=[0.0, 0.7, 1 / 3],
    )
    tp = Loopback()
    sent.send(tp)
    StepInputs.send_stop(tp)
    got = StepInputs.recv(tp)
    assert np.array_equal(got.host, host)
    for name in (
        "num_tokens",
        "num_seqs",
        "width",
        "num_pending",
        "num_logit_rows",
        "max_seqlen_q",
        "num_decodes",
        "sample",
        "local",
        "block_copies",
        "kv_swap_out",
        "kv_swap_in",
        "local_block_copies",
        "prompt_logprob_rows",
        "long_context",
        "replica_call",
        "temperatures",
    ):
        assert getattr(got, name) == getattr(sent, name), name
    assert StepInputs.recv(tp) is None
