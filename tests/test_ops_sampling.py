"""draft_argmax, offset_positions and minimum against plain-Python references."""

from __future__ import annotations

import math

import torch
from draftgraph.ops.sampling import vocab_chunks
from draftgraph.runtime.ir.op_registry import get_op
from v4_op_cases import BATCH, draft_argmax_case, gen, minimum_case, offset_positions_case, run_op


def ref_draft(logits, limit, mask=None):
    """Per row: (token, prob) over allowed t: t < limit and bit t % 32 of word t // 32."""
    tokens, probs = [], []
    for b in range(logits.shape[0]):
        allowed = []
        for t in range(logits.shape[1]):
            word = int(mask[b, t // 32]) & 0xFFFFFFFF if mask is not None else 0xFFFFFFFF
            if t < int(limit[0]) and (word >> (t % 32)) & 1:
                allowed.append(t)
        if not allowed:
            tokens.append(0)
            probs.append(0.0)
            continue
        values = [float(logits[b, t]) for t in allowed]
        top = max(values)
        tokens.append(allowed[values.index(top)])  # first (lowest id) of ties
        probs.append(1.0 / sum(math.exp(v - top) for v in values))
    return torch.tensor(tokens), torch.tensor(probs, dtype=torch.float64)


def check_against_ref(inputs):
    token, prob = run_op("draft_argmax", inputs, {})
    ref_token, ref_prob = ref_draft(*inputs)
    assert token.dtype == torch.int64 and prob.dtype == torch.float32
    assert torch.equal(token, ref_token), (token, ref_token)
    torch.testing.assert_close(prob.double(), ref_prob, rtol=1e-5, atol=1e-7)
    return token, prob


def test_unmasked_is_plain_argmax_with_softmax_prob():
    inputs, _ = draft_argmax_case(gen(51), with_mask=False)
    token, prob = check_against_ref(inputs)
    assert torch.equal(token, inputs[0].argmax(-1))
    torch.testing.assert_close(prob, torch.softmax(inputs[0], -1).amax(-1))


def test_vocab_limit_excludes_high_tokens():
    inputs, _ = draft_argmax_case(gen(52), with_mask=False, limit=500)
    inputs[0][:, 900] = 100.0  # the global max sits past the limit
    token, prob = check_against_ref(inputs)
    assert (token < 500).all()
    assert (prob < 1.0).all()  # the excluded token's mass is not in the softmax either


def test_random_mask_with_sign_bits():
    inputs, _ = draft_argmax_case(gen(53), with_mask=True)
    assert (inputs[2] < 0).any(), "the mask should have words with bit 31 set"
    check_against_ref(inputs)


def test_bit_31_of_a_word_allows_its_token():
    inputs, _ = draft_argmax_case(gen(54), with_mask=True)
    mask = torch.zeros_like(inputs[2])
    mask[:, 0] = -(2**31)  # only bit 31 of word 0: token 31
    mask[0, 1] = 1 << 3  # row 0 also allows token 35, with a lower logit
    inputs[2] = mask
    inputs[0][0, 35] = inputs[0][0, 31] - 1.0
    token, prob = check_against_ref(inputs)
    assert token.tolist() == [31] * BATCH
    assert prob[1] == 1.0 and prob[0] < 1.0


def test_all_zero_mask_gives_token_zero_and_prob_zero():
    inputs, _ = draft_argmax_case(gen(55), with_mask=True)
    inputs[2] = torch.zeros_like(inputs[2])
    inputs[2][2, 3] = 1 << 5  # row 2 keeps token 101
    token, prob = check_against_ref(inputs)
    assert token.tolist() == [0, 0, 101]
    assert prob.tolist() == [0.0, 0.0, 1.0]


def test_limit_zero_allows_nothing():
    inputs, _ = draft_argmax_case(gen(56), with_mask=False, limit=0)
    token, prob = check_against_ref(inputs)
    assert token.tolist() == [0] * BATCH and prob.tolist() == [0.0] * BATCH


def test_ties_go_to_the_lowest_id():
    inputs, _ = draft_argmax_case(gen(57), with_mask=True)
    inputs[2] = torch.full_like(inputs[2], -1)  # everything allowed
    inputs[0][:, [17, 400, 901]] = 50.0
    token, prob = check_against_ref(inputs)
    assert token.tolist() == [17] * BATCH
    torch.testing.assert_close(prob, torch.full((BATCH,), 1 / 3))


CHUNKED_VOCAB = 6000  # reduced as 6 chunks of 1000: the two-stage path (V-Flash's 129280 is 128 x 1010)


def test_chunked_vocab_reduces_in_two_stages():
    assert vocab_chunks(CHUNKED_VOCAB) == 6 and vocab_chunks(129280) == 128
    assert vocab_chunks(997) == 1  # a prime vocab: one stage


def test_chunked_vocab_matches_the_reference_with_mask_and_limit():
    inputs, _ = draft_argmax_case(gen(59), with_mask=True, vocab=CHUNKED_VOCAB, limit=4321)
    check_against_ref(inputs)


def test_chunked_ties_across_chunks_go_to_the_lowest_id():
    inputs, _ = draft_argmax_case(gen(60), with_mask=False, vocab=CHUNKED_VOCAB)
    inputs[0][:, [5999, 3500, 2999, 1000]] = 50.0  # equal tops in four chunks, one at a chunk's start
    inputs[0][1, 999] = 50.0  # row 1: also the last id of chunk 0
    token, prob = check_against_ref(inputs)
    assert token.tolist() == [1000, 999, 1000]
    torch.testing.assert_close(prob, torch.tensor([1 / 4, 1 / 5, 1 / 4]))


def test_chunked_nan_logit_wins_with_confidence_zero():
    inputs, _ = draft_argmax_case(gen(61), with_mask=False, vocab=CHUNKED_VOCAB)
    inputs[0][0, 4444] = float("nan")
    inputs[0][2] = float("-inf")  # row 2: nothing finite
    token, prob = run_op("draft_argmax", inputs, {})
    assert token[0] == 4444 and prob[0] == 0.0  # as torch.argmax: NaN is the max
    assert token[2] == 0 and prob[2] == 0.0
    assert torch.equal(token[1], inputs[0][1].argmax())


def test_offset_positions_adds_on_device():
    inputs, attrs = offset_positions_case(gen(58))
    (out,) = run_op("offset_positions", inputs, attrs)
    assert torch.equal(out, inputs[0] + 3)
    pos = inputs[0].clone()
    get_op("offset_positions").impl([pos], [pos], attrs, None)  # in place, as the chain does
    assert torch.equal(pos, inputs[0] + 3)


def test_minimum_elementwise_and_in_place():
    inputs, _ = minimum_case(gen(59))
    (out,) = run_op("minimum", inputs, {})
    assert torch.equal(out, torch.minimum(*inputs))
    a = inputs[0].clone()
    get_op("minimum").impl([a, inputs[1]], [a], {}, None)
    assert torch.equal(a, out)
