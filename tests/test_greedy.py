"""The fused step's greedy launch in numba's CUDA simulator, against torch.argmax and a row copy."""
from __future__ import annotations

import pytest
import torch

from trapetum import gemv
from trapetum.greedy import LOADS, NT, Greedy

pytestmark = pytest.mark.skipif(not gemv.SIM, reason="written for the CUDA simulator")


def buffers(V, hidden=8, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, V, generator=g).half()
    emb = torch.randn(V, hidden, generator=g).half()
    h = torch.full((1, hidden), float("nan"), dtype=torch.float16)
    z = lambda *s: torch.zeros(*s, dtype=torch.long)  # noqa: E731
    return logits, emb, h, z(n), z(1, 1), torch.tensor([7]), z(1)


@pytest.mark.parametrize("V", [5, NT - 1, 3 * NT + 7, 8 * LOADS * NT + 13])  # the last: two rounds of loads
def test_greedy_token_is_recorded_and_embedded(V):
    logits, emb, h, tokens, tok, pos, i = buffers(V, seed=V)
    g = Greedy(logits, tokens, tok, pos, i, emb, h)
    want = int(logits.argmax())
    g()
    assert tokens[0] == want and tok.item() == want and pos.item() == 8 and i.item() == 1
    assert torch.equal(h[0], emb[want])
    logits[0, V // 2] = 100.0
    g()
    assert tokens[1] == V // 2 and tok.item() == V // 2 and pos.item() == 9 and i.item() == 2
    assert torch.equal(h[0], emb[V // 2])


def test_ties_take_the_first_index_and_nan_ranks_first_as_in_torch():
    V = 2 * NT + 3
    logits, _, _, tokens, tok, pos, i = buffers(V)
    logits.fill_(-1.0)
    logits[0, [NT + 5, 9, 2 * NT + 1]] = 3.0  # a tie across threads and warps
    Greedy(logits, tokens, tok, pos, i)()
    assert tokens[0] == 9 == int(logits.float().argmax())
    logits[0, 2 * NT] = float("nan")
    Greedy(logits, tokens, tok, pos, i)()
    assert tokens[1] == 2 * NT == int(logits.float().argmax())


def test_past_the_last_slot_nothing_is_recorded():
    logits, _, _, tokens, tok, pos, i = buffers(10, n=1)
    g = Greedy(logits, tokens, tok, pos, i)
    g()
    g()  # i = 1 = len(tokens): tok and pos still advance, tokens is not written out of bounds
    assert i.item() == 2 and tok.item() == int(logits.argmax()) and tokens.tolist() == [tok.item()]


def test_bad_buffers_are_refused():
    logits, emb, h, tokens, tok, pos, i = buffers(10)
    with pytest.raises(ValueError, match="logits"):
        Greedy(logits.float(), tokens, tok, pos, i)
    with pytest.raises(ValueError, match="tokens"):
        Greedy(logits, tokens.int(), tok, pos, i)
    with pytest.raises(ValueError, match="one element"):
        Greedy(logits, tokens, torch.zeros(2, dtype=torch.long), pos, i)
    with pytest.raises(ValueError, match="embedding"):
        Greedy(logits, tokens, tok, pos, i, emb[:9], h)
    with pytest.raises(ValueError, match="embedding"):
        Greedy(logits, tokens, tok, pos, i, emb.float(), h)
