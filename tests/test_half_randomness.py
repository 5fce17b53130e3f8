"""A half's own generators (halves.randomness, engine.replay.HalfRandomness), op by op: what a
recorded half draws equals a plain run's draws from the same global state, leaves the global
generator where a plain run leaves it, and replays bitwise wherever the global generator stands."""
import pytest
import torch
import torch.nn.functional as F

from revtriton.engine.replay import HalfRandomness
from revtriton.halves.randomness import half_generator

X = torch.ones(2, 3, 16, dtype=torch.float64)

DRAWS = {  # each draws with no generator argument, as code inside a half does
    "bernoulli_": lambda: torch.empty(64).bernoulli_(0.5),  # (nn.Dropout on CPU)
    "rand": lambda: torch.rand(5, 7),  # rand.default: routed to rand.generator
    "randn_like": lambda: torch.randn_like(X),
    "randint": lambda: torch.randint(0, 9, (11,)),
    "randperm": lambda: torch.randperm(13),
    "native_dropout": lambda: torch.native_dropout(X, 0.5, True)[0],  # no generator overload: swapped
    "dropout": lambda: F.dropout(X, 0.25),
    "sdpa-dropout": lambda: F.scaled_dot_product_attention(X, X, X, dropout_p=0.3),
    "two-draws": lambda: torch.rand(3) + F.dropout(X, 0.5).sum(),
}


def recorded(draw):
    states = []
    with HalfRandomness.recorded(states):
        out = draw()
    return out, states[0]


@pytest.mark.parametrize("name", list(DRAWS))
def test_a_half_draws_what_a_plain_run_draws_and_replays_it(seeded, name):
    draw = DRAWS[name]
    before = torch.get_rng_state()
    out, draws = recorded(draw)
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    assert torch.equal(draw(), out)  # the numbers a plain run draws
    assert torch.equal(torch.get_rng_state(), after)  # and the global generator left where it leaves it
    torch.rand(17)  # the global generator moves on (another thread, the next step)
    moved = torch.get_rng_state()
    for _ in range(2):  # replayed (twice: a retained graph's second backward)
        with HalfRandomness.replayed(draws):
            assert torch.equal(draw(), out)
    assert torch.equal(torch.get_rng_state(), moved)  # the replay leaves the global generator alone
    assert draws.routed


def test_a_half_that_draws_nothing_records_nothing(seeded):
    before = torch.get_rng_state()
    states = []
    with HalfRandomness.recorded(states):
        q = torch.ones(2, 2, 3, 8)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)  # a random op's kernel (flash, CPU) at rate 0
        torch.native_dropout(X, 0.5, False)  # and with train False
        torch.rand(3, generator=torch.Generator().manual_seed(1))  # a generator of the caller's
    assert states == [None]
    assert torch.equal(torch.get_rng_state(), before)


def test_draws_asking_for_the_half_generator_need_no_routing(seeded):
    x = torch.empty(50)
    assert half_generator(x.device) is None  # outside a half: the global generator
    before = torch.get_rng_state()
    states = []
    with HalfRandomness.recorded(states, "own"):
        out = x.bernoulli_(0.5, generator=half_generator(x.device)).clone()
    (draws,) = states
    assert draws.kind == "own"
    torch.set_rng_state(before)
    assert torch.equal(torch.empty(50).bernoulli_(0.5), out)
    torch.rand(9)
    with HalfRandomness.replayed(draws):
        assert torch.equal(x.bernoulli_(0.5, generator=half_generator(x.device)), out)


def test_a_half_inside_a_half_forks_from_the_enclosing_one(seeded):
    """A stack run inside another stack's half: the inner half's draws come from (and advance) the
    outer half's generator, so the outer replay redraws them too."""
    def outer():
        inner_states = []
        first = torch.rand(4)
        with HalfRandomness.recorded(inner_states):
            inner = torch.rand(4)
        return torch.cat([first, inner, torch.rand(4)]), inner_states[0]

    before = torch.get_rng_state()
    states = []
    with HalfRandomness.recorded(states):
        out, _ = outer()
    torch.set_rng_state(before)
    assert torch.equal(torch.rand(12), out)  # one stream, as a plain run
    torch.rand(5)
    with HalfRandomness.replayed(states[0]):
        again, _ = outer()
    assert torch.equal(again, out)
