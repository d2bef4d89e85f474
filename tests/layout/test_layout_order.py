"""Layout.from_order reproduces Megatron-Core's RankGenerator groups.

The oracle below is written here from Megatron's documented semantics: the first token of the
order varies fastest, a group varies the masked tokens (fastest first inside the group), and
groups enumerate the other tokens (fastest first). It uses plain nested loops over strides.
"""

import itertools
import random

import pytest

from meshgroups import Layout

TOKENS = ("tp", "cp", "ep", "dp", "pp")


def megatron_groups(order, sizes, token):
    tokens = order.split("-")
    wanted = token.split("-")
    stride, strides = 1, {}
    for t in tokens:  # fastest first
        strides[t] = stride
        stride *= sizes[t]
    inside = [t for t in tokens if t in wanted]
    outside = [t for t in tokens if t not in wanted]

    def enumerate_fastest_first(names):
        ranges = [range(sizes[t]) for t in reversed(names)]
        for combo in itertools.product(*ranges):  # last of reversed = first token varies fastest
            yield dict(zip(reversed(names), combo))

    groups = []
    for outer in enumerate_fastest_first(outside):
        base = sum(outer[t] * strides[t] for t in outside)
        groups.append(
            [base + sum(inner[t] * strides[t] for t in inside) for inner in enumerate_fastest_first(inside)]
        )
    return groups


def random_configs(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        order = list(TOKENS)
        rng.shuffle(order)
        sizes = {t: rng.choice([1, 1, 2, 3, 4]) for t in TOKENS}
        yield "-".join(order), sizes


@pytest.mark.parametrize(("order", "sizes"), list(random_configs(60)))
def test_from_order_matches_megatron_for_every_token_combination(order, sizes):
    lay = Layout.from_order(order, **sizes)
    for k in range(1, 4):
        for combo in itertools.combinations(TOKENS, k):
            token = "-".join(combo)
            assert lay.groups(*combo).tolist() == megatron_groups(order, sizes, token), token


def test_from_order_examples():
    lay = Layout.from_order("tp-dp-pp", tp=2, dp=2, pp=4)
    assert lay == Layout(pp=4, dp=2, tp=2)
    assert lay.groups("dp").tolist()[:2] == [[0, 2], [1, 3]]
    # Megatron docstring example: 16 GPUs, tp=2, pp=4 -> pp groups [g0, g4, g8, g12], ...
    assert lay.groups("pp").tolist()[0] == [0, 4, 8, 12]
    # a size-1 dim missing from the order is appended (outermost), as Megatron does
    assert Layout.from_order("tp-dp", tp=2, dp=2, ep=1).names == ("ep", "dp", "tp")


def test_from_order_errors():
    with pytest.raises(ValueError, match="token 'xp' of order 'tp-xp' has no size"):
        Layout.from_order("tp-xp", tp=2)
    with pytest.raises(ValueError, match="token 'tp' appears twice"):
        Layout.from_order("tp-dp-tp", tp=2, dp=2)
    with pytest.raises(ValueError, match="cp=2 but 'cp' is missing from order 'tp-dp'"):
        Layout.from_order("tp-dp", tp=2, dp=2, cp=2)
    with pytest.raises(ValueError, match="empty token"):
        Layout.from_order("tp--dp", tp=2, dp=2)
    with pytest.raises(ValueError, match="tp=0"):
        Layout.from_order("tp-dp", tp=0, dp=2)
    with pytest.raises(TypeError, match="order must be a str"):
        Layout.from_order(["tp"], tp=2)
