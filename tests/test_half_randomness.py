"""A half's own generators (halves.randomness, engine.replay.HalfRandomness), op by op: what a
recorded half draws equals a plain run's draws from the same global state, leaves the global
generator where a plain run leaves it, and replays bitwise wherever the global generator stands.
The routing (a torch function mode) meets the torch functions a half calls, not the aten ops inside
them: every random one is named (RANDOM_FUNCTIONS), and the ones the names miss would escape."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from revtriton.engine.replay import RANDOM_ATEN_OPS, HalfRandomness
from revtriton.halves.randomness import half_generator

X = torch.ones(2, 3, 16, dtype=torch.float64)
LSTM = nn.LSTM(16, 16, num_layers=2, dropout=0.5, dtype=torch.float64)
ATTENTION = nn.MultiheadAttention(16, 2, dropout=0.5, dtype=torch.float64)

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
    # torch's Python functions that draw inside: the mode meets them, not what they call
    "dropout2d": lambda: F.dropout2d(X[None], 0.5),
    "alpha_dropout": lambda: F.alpha_dropout(X, 0.5, training=True),
    "feature_alpha_dropout": lambda: F.feature_alpha_dropout(X, 0.5, training=True),
    "rrelu": lambda: F.rrelu(X, training=True),
    "gumbel_softmax": lambda: F.gumbel_softmax(X, tau=0.5),
    "multi_head_attention": lambda: ATTENTION(X, X, X)[0],  # (nn.Module's training default: on)
    "lstm-dropout": lambda: LSTM(X)[0],
    "trunc_normal_": lambda: nn.init.trunc_normal_(torch.empty(9)),
    # Tensor methods (a timm DropPath: new_empty(...).bernoulli_(keep))
    "drop-path": lambda: X.new_empty(2, 1, 1).bernoulli_(0.75),
    "random_": lambda: torch.empty(9, dtype=torch.int64).random_(0, 100),
    "exponential_": lambda: torch.empty(9).exponential_(),
    "multinomial": lambda: torch.ones(7).multinomial(3),
    "normal-on-a-device": lambda: torch.normal(0.0, 1.0, (6,), device="cpu"),
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
    attention_in_eval = nn.MultiheadAttention(16, 2, dropout=0.5, dtype=torch.float64).eval()
    lstm_without_dropout = nn.LSTM(16, 16, num_layers=2, dtype=torch.float64)
    before = torch.get_rng_state()
    states = []
    with HalfRandomness.recorded(states):
        q = torch.ones(2, 2, 3, 8)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)  # a random op's kernel (flash, CPU) at rate 0
        torch.native_dropout(X, 0.5, False)  # and with train False
        torch.rand(3, generator=torch.Generator().manual_seed(1))  # a generator of the caller's
        torch.poisson(X, torch.Generator().manual_seed(2))  # (given in its place)
        F.dropout(X, 0.0, training=True)  # a dropout at rate 0, or not training (eval mode)
        nn.Dropout(0.5).eval()(X)
        F.rrelu(X)  # (training False by default)
        attention_in_eval(X, X, X)
        lstm_without_dropout(X)
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


def test_a_dropout_inside_a_half_inside_a_half_draws_from_the_inner_half():
    """A routed call runs as it is inside: the enclosing half's mode, which meets what the call runs
    (F.dropout's torch.dropout), lets it be; else the inner half's draws would come from the outer's
    generator, and the outer's next draws repeat them."""
    def outer():
        inner_states = []
        first = torch.rand(4)
        with HalfRandomness.recorded(inner_states):
            inner = F.dropout(torch.ones(64), 0.5)
        return torch.cat([first, inner, torch.rand(4)]), inner_states[0]

    torch.manual_seed(3)
    want = torch.cat([torch.rand(4), F.dropout(torch.ones(64), 0.5), torch.rand(4)])
    torch.manual_seed(3)
    states = []
    with HalfRandomness.recorded(states):
        out, inner_draws = outer()
    assert torch.equal(out, want) and inner_draws.routed
    torch.rand(5)
    with HalfRandomness.replayed(states[0]):
        again, _ = outer()
    assert torch.equal(again, want)


def test_every_aten_op_that_draws_is_routed_by_name():
    """The routing meets torch functions by name: each aten op of the installed torch that draws
    (tagged nondeterministic_seeded, or taking a generator) must be in RANDOM_ATEN_OPS, or a half
    calling it would draw from the global generator (then replayed from the global start only, not
    safe against other threads)."""
    drawing = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "aten":
            continue
        name = name.split(".")[0]
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or name in drawing:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.nondeterministic_seeded in op.tags or any(a.name == "generator"
                                                                     for a in op._schema.arguments):
                drawing.add(name)
                break
    assert drawing and drawing <= RANDOM_ATEN_OPS, sorted(drawing - RANDOM_ATEN_OPS)
