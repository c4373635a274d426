"""A grammar's lanes (structured/backend.py): samples of one grammar spread over matchers compiled apart, so that the
mask threads do not queue on one lexer's lock; a lane is added only while every lane has a live sample, and the masks
are the ones a single lane gives."""

import random

import numpy as np
import pytest
import torch
from checkpoints import write_tokenizer
from structured_cases import SCHEMAS
from transformers import AutoTokenizer

from nanoserve.structured.backend import GrammarCompiler, GrammarState
from nanoserve.structured.params import StructuredOutputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("lanes-tokenizer")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_samples_spread_over_lanes_only_while_they_run_together(tokenizer):
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), num_threads=3)
    compiled = compiler.compile(StructuredOutputs(json=SCHEMAS["person"]).compiled)
    for _ in range(3):  # one sample at a time: one lane
        assert GrammarState(compiled).lane == 0
    assert len(compiled.lanes) == 1 and compiled.users == [0]
    states = [GrammarState(compiled) for _ in range(7)]
    assert len(compiled.lanes) == 3 and sorted(compiled.users) == [2, 2, 3]
    assert sorted(s.lane for s in states) == [0, 0, 0, 1, 1, 2, 2]
    del states[:3]
    assert sum(compiled.users) == 4
    extra = GrammarState(compiled)  # goes to the least used lane (kept, or its lane would be given back at once)
    assert max(compiled.users) - min(compiled.users) <= 1
    del extra


def test_lane_masks_are_one_lanes_masks(tokenizer):
    grammar = StructuredOutputs(json=SCHEMAS["order"]).compiled
    rows = 9
    lanes = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), num_threads=3)
    one = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), num_threads=1)
    states = [GrammarState(c) for c in (lanes.compile(grammar), one.compile(grammar)) for _ in range(rows)]
    many, single = states[:rows], states[rows:]
    assert {s.lane for s in many} == {0, 1, 2} and {s.lane for s in single} == {0}
    rng = random.Random(0)
    for _ in range(40):
        bits = torch.empty((rows, lanes.mask_words), dtype=torch.int32)
        ref = torch.empty((rows, one.mask_words), dtype=torch.int32)
        lanes.fill(many, bits)
        one.fill(single, ref)
        assert torch.equal(bits, ref)
        allowed = np.unpackbits(ref.numpy().view(np.uint8), axis=1, bitorder="little")
        for i in range(rows):
            token = rng.choice(np.flatnonzero(allowed[i]).tolist())
            assert many[i].matcher.consume_token(token) and single[i].matcher.consume_token(token)
