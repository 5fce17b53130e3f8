"""engine.graphs.CapturedStep's host logic on a CPU (issue 35): warm-up, capture, static inputs and
outputs, gradients that stay the graph's, exact streams' checks read after replays, and the errors
where a step cannot be captured. A stand-in backend "captures" by running the step once under the
rules of a capture (no host sync; checks wait) and "replays" by running it again under the same
rules; tests/test_gpu.py runs the real CUDA graphs. CUDA's rule for random numbers, that a graph
draws only from generator states registered before its capture, is kept where a test asks for it
(``graph_draws``): the halves' draws then go through halves.randomness.GraphDraws.
"""
import pytest
import torch
from torch import nn

import revtriton
from revtriton.engine import checks
from revtriton.engine.graphs import HOST_SYNC_HINT, CapturedStep
from test_host_sync import CountSyncs
from test_pareprop import build


class RerunGraphs:
    """A CUDA graph's stand-in: the capturing call runs the step (a graph's capture records it and
    its first replay runs it); each later replay runs it again, writing the outputs and the
    gradients into the captured tensors as a graph's kernels would."""

    def __init__(self):
        self.warm_ups = self.captures = self.replays = 0
        self.step = None  # the CapturedStep (for its gradient buffers)

    def warm_up(self, run):
        self.warm_ups += 1
        return run()

    def capture(self, run, pool, generators=()):
        self.captures += 1
        self.generators = list(generators)  # (a graph registers them before its capture)
        out = self._run_as_captured(run)
        return {"run": run, "fresh": True, "outputs": out}, out

    def replay(self, graph):
        self.replays += 1
        if graph["fresh"]:  # the capturing call: the capture already ran it
            graph["fresh"] = False
            return
        _copy_into(graph["outputs"], self._run_as_captured(graph["run"]))
        for p, buffer in self.step._grads if self.step is not None else ():
            if p.grad is not None and p.grad is not buffer:
                buffer.copy_(p.grad)

    @staticmethod
    def _run_as_captured(run):
        with checks.capturing(), CountSyncs() as syncs:
            out = run()
        if syncs.total():
            raise RuntimeError(f"operation not permitted when stream is capturing (stand-in: {dict(syncs.counts)})")
        return out


def _copy_into(static, new):
    if isinstance(static, torch.Tensor):
        static.copy_(new)
    elif isinstance(static, dict):
        for key in static:
            _copy_into(static[key], new[key])
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, new):
            _copy_into(a, b)


def captured(train_step, **options):
    backend = RerunGraphs()
    step = CapturedStep(train_step, _backend=backend, **options)
    backend.step = step
    return step, backend


def trainer(stack, optimizer, set_to_none=True):
    def train_step(x, target):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = (stack(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


@pytest.fixture(params=[False, True], ids=["eager-draws", "graph-draws"])
def graph_draws(request, monkeypatch):
    """With True the stand-in keeps CUDA's rule for random numbers: a draw while capturing or
    replaying goes through halves.randomness.GraphDraws (the forward from the global generator, each
    recompute from a generator made before the capture)."""
    if request.param:
        from revtriton.halves import randomness

        monkeypatch.setattr(randomness, "graph_capturing", lambda device: checks.capturing_now())
    return request.param


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("depth", [3, 4])
def test_a_captured_step_trains_bitwise_as_the_eager_step(seeded, schedule, depth, graph_draws):
    """Exact streams, dropout and drop-path: losses and parameters after every step bitwise the
    eager run's, through the warm-up, the capturing call and the replays; with the graph's rule for
    draws too (each recompute draws from its own registered generator)."""
    stacks = [build(depth, schedule, True, seed=seeded) for _ in range(2)]
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.05, momentum=0.9) for s in stacks]
    eager = trainer(stacks[0], optimizers[0])
    step, backend = captured(trainer(stacks[1], optimizers[1]), warmup=2)
    batches = [(torch.randn(2, 3, 12), torch.randn(2, 3, 12)) for _ in range(6)]
    for i, batch in enumerate(batches):
        torch.manual_seed(seeded + i)
        expected = eager(*batch)
        torch.manual_seed(seeded + i)
        got = step(*batch)
        assert torch.equal(got, expected), i
        assert all(torch.equal(a, b) for a, b in zip(stacks[0].parameters(), stacks[1].parameters())), i
        assert step.captured == (i >= 2)
    assert (backend.warm_ups, backend.captures, backend.replays) == (2, 1, 4)
    assert step.static_inputs[0] is not batches[-1][0] and torch.equal(step.static_inputs[0], batches[-1][0])
    # every half draws (dropout in its MLP, drop-path): a fork each, a recompute each, a generator each
    assert len(step._draws.forks) == len(step._draws.replays) == 2 * depth
    assert sorted(step._draws.replays) == list(range(2 * depth))
    assert len(backend.generators) == 0  # (registered with a graph: CUDA's only)


def test_outputs_are_the_graphs_tensors_and_gradients_stay_its_buffers(seeded):
    """zero_grad(set_to_none=True) outside the step cannot free the graph's gradient buffers: the
    next replay writes them and puts them back, with the eager step's values."""
    stacks = [build(2, "sequential", True, seed=seeded) for _ in range(2)]
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.01) for s in stacks]
    eager = trainer(stacks[0], optimizers[0])
    step, _ = captured(trainer(stacks[1], optimizers[1]), warmup=1)
    x, target = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    for i in range(2):  # (each step's dropout masks the same: the same seed)
        torch.manual_seed(seeded + i)
        eager(x, target)
        torch.manual_seed(seeded + i)
        first = step(x, target)  # the second call captures
    buffers = {p: p.grad for p in stacks[1].parameters()}
    assert all(g is not None for g in buffers.values())
    optimizers[1].zero_grad(set_to_none=True)
    torch.manual_seed(seeded)
    eager(x * 2, target)
    torch.manual_seed(seeded)
    second = step(x * 2, target)
    assert second is first  # the same tensor, overwritten by each replay
    for p, q in zip(stacks[0].parameters(), stacks[1].parameters()):
        assert q.grad is buffers[q] and torch.equal(q.grad, p.grad) and torch.equal(q, p)


def test_a_host_sync_in_the_step_fails_the_capture_naming_it(seeded):
    stack = build(2, "sequential", True, seed=seeded)
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.01)
    inner = trainer(stack, optimizer)

    def logging_step(x, target):
        loss = inner(x, target)
        print(f"loss {loss.item():.3f}")  # a host sync
        return loss

    step, _ = captured(logging_step, warmup=1)
    batch = (torch.randn(2, 3, 12), torch.randn(2, 3, 12))
    step(*batch)  # eager: fine
    with pytest.raises(RuntimeError, match=r"could not be captured.*host sync.*\.item\(\)"):
        step(*batch)
    assert not step.captured


def test_other_shapes_non_tensors_and_a_bad_warmup_raise(seeded):
    stack = build(2, "sequential", True, seed=seeded)
    step, _ = captured(trainer(stack, torch.optim.SGD(stack.parameters(), lr=0.01)), warmup=1)
    x, target = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    step(x, target)
    step(x, target)
    with pytest.raises(ValueError, match=r"input 0 is \(3, 3, 12\).*captured with \(2, 3, 12\).*fixed shapes"):
        step(torch.randn(3, 3, 12), target)
    with pytest.raises(ValueError, match=r"input 1 is .*torch.float64"):
        step(x, target.double())
    with pytest.raises(TypeError, match="pass tensors only"):
        step(x, 1.0)
    for warmup in (0, True, 1.5):
        with pytest.raises(ValueError, match="warmup must be an int >= 1"):
            CapturedStep(lambda: None, warmup=warmup, _backend=RerunGraphs())
    with pytest.raises(TypeError, match="callable"):
        CapturedStep(None, _backend=RerunGraphs())


def test_an_optimizer_that_is_not_capturable_raises_at_capture():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), capturable=False)

    def train_step(x):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    step, _ = captured(train_step, warmup=1)
    step(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"Adam was created with capturable=False.*capturable=True"):
        step(torch.randn(2, 4))


def test_a_scheduler_changing_a_float_learning_rate_after_capture_raises():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def train_step(x):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    step, _ = captured(train_step, warmup=1)
    x = torch.randn(2, 4)
    step(x)
    step(x)  # captured with lr 0.1
    step(x)
    scheduler.step()
    with pytest.raises(RuntimeError, match=r"learning rate changed after the capture \(0\.1 -> 0\.05.*tensor lr"):
        step(x)


class FlakyHalf(nn.Module):
    """A half whose recompute differs from its forward once ``broken`` (a Python-side count)."""

    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.broken, self.calls = False, 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out + self.calls * 1e-3 if self.broken else out


def test_a_replays_failed_exact_check_is_raised_by_check_and_by_check_step(seeded):
    torch.manual_seed(seeded)
    half = FlakyHalf(8)
    stack = revtriton.ReversibleStack([revtriton.ReversibleBlock(half, nn.Linear(8, 8))], exact=True)
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.01)
    step, _ = captured(trainer(stack, optimizer), warmup=1)
    x, target = torch.randn(2, 8), torch.randn(2, 8)
    step(x, target)
    step(x, target)  # captured
    step(x, target)
    step.check()  # nothing failed: no error
    with CountSyncs() as syncs:
        revtriton.check_step()  # the captured step's flag read with the rest: one sync
    assert syncs.total() == 1, syncs.counts
    half.broken = True  # (a real graph would replay the same kernels: the stand-in reruns the Python)
    step(x, target)
    half.broken = False
    step(x, target)  # a good replay after the bad one: the failure is kept
    with pytest.raises(RuntimeError, match="a replay of the captured step failed its exact-stream check.*update was applied"):
        step.check()
    step.check()  # read and cleared
    half.broken = True
    step(x, target)
    half.broken = False
    with pytest.raises(RuntimeError, match="failed its exact-stream check"):
        revtriton.check_step()


def test_a_half_drawing_in_a_capture_not_captured_steps_raises_naming_it(seeded, monkeypatch):
    """A CUDA graph draws only from generator states registered before its capture: a user's own
    capture of a stack whose halves draw raises, naming CapturedStep (which registers them)."""
    from revtriton.halves import randomness

    monkeypatch.setattr(randomness, "graph_capturing", lambda device: checks.capturing_now())
    stack = build(2, "sequential", True, seed=seeded)  # dropout and drop-path
    x = torch.randn(2, 3, 12)
    stack(x)  # eagerly: the plan learns how its halves draw
    with checks.capturing(), pytest.raises(NotImplementedError,
                                           match=r"not revtriton.CapturedStep's.*registered"):
        stack(x)
    checks.check_step()


def test_a_capture_that_draws_otherwise_than_its_warm_up_raises(seeded, graph_draws):
    """Each recompute's generator is placed from what the last warm-up call recorded: a captured
    step that forks more (here a second forward, taken only from the third call) raises at capture,
    also where its draws are not the graph's (a CPU half's, counted to keep the order)."""
    stack = build(2, "sequential", True, seed=seeded)
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.01)
    twice = []

    def train_step(x, target):
        optimizer.zero_grad()
        loss = (stack(x) - target).square().mean()
        if twice:
            loss = loss + stack(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    step, _ = captured(train_step, warmup=2)
    batch = (torch.randn(2, 3, 12), torch.randn(2, 3, 12))
    step(*batch)
    step(*batch)
    twice.append(True)
    with pytest.raises(RuntimeError, match=r"drew random numbers differently from its last warm-up call"):
        step(*batch)
    assert not step.captured and not checks.capturing_now()


def test_recomputes_in_autograds_device_thread_draw_as_planned(seeded, monkeypatch):
    """On CUDA autograd runs the backward (the recomputes) in its device thread, not the caller's:
    the plan is process-wide while a CapturedStep call runs, and the capture state a stream's (here:
    a capture in progress on any thread). Float streams, so no check waits on the thread."""
    import threading

    from revtriton.halves import randomness

    def capturing(device):
        plan = randomness._graph_plan
        return plan is not None and plan._mode == "captured"

    monkeypatch.setattr(randomness, "graph_capturing", capturing)
    stacks = [build(3, "pareprop", False, seed=seeded) for _ in range(2)]
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.05) for s in stacks]

    def threaded(stack, optimizer):
        def train_step(x, target):
            optimizer.zero_grad()
            loss = (stack(x) - target).square().mean()
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
            optimizer.step()
            return loss.detach()
        return train_step

    eager = threaded(stacks[0], optimizers[0])
    step, _ = captured(threaded(stacks[1], optimizers[1]), warmup=1)
    for i in range(3):
        batch = (torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64))
        torch.manual_seed(seeded + i)
        expected = eager(*batch)
        torch.manual_seed(seeded + i)
        assert torch.equal(step(*batch), expected), i
        assert all(torch.equal(a, b) for a, b in zip(stacks[0].parameters(), stacks[1].parameters())), i
    assert step.captured and len(step._draws.replays) == 6


class FakePhilox:
    """A CUDA generator's host side (a seed, an offset that each draw moves on), for GraphDraws'
    arithmetic on a machine with no GPU."""

    def __init__(self, seed=0, offset=0):
        self.seed, self.offset = seed, offset

    def draw(self, n):
        self.offset += n
        return self

    def clone_state(self):
        return FakePhilox(self.seed, self.offset)

    def graphsafe_get_state(self):
        return self  # (shares the state)

    def get_state(self):
        return (self.seed, self.offset)

    def set_state(self, state):
        self.seed, self.offset = state

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset

    def initial_seed(self):
        return self.seed

    def manual_seed(self, seed):
        self.seed, self.offset = seed, 0
        return self


def test_graph_draws_places_each_recompute_at_its_forks_offset(monkeypatch):
    """The warm-up records each fork's global offset from the step's start and which fork each
    recompute replays; before a replay each recompute's generator is set to the global seed and
    offset plus its fork's (what the graph's forward will draw from at that point)."""
    from revtriton.halves import randomness
    from revtriton.halves.randomness import GraphDraws, HalfGenerators

    cuda = torch.device("cuda", 0)
    global_generator = FakePhilox(seed=3, offset=100)
    monkeypatch.setattr(randomness, "default_generator", lambda device: global_generator)
    monkeypatch.setattr(randomness, "_graph_generator", lambda device: FakePhilox())
    monkeypatch.setattr(randomness, "graph_capturing", lambda device: False)  # (eager warm-up)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plan = GraphDraws()
    with plan.warming_up():
        global_generator.draw(8)  # the step draws before the stack (an embedding's dropout)
        halves = []
        for n in (12, 4):  # two halves' forwards, each forking at its first draw
            with HalfGenerators() as half:
                half.generator(cuda).draw(n)
                half.generator(cuda).draw(n)  # (the same generator: one fork a half)
            half.advance_source()
            halves.append(half)
        assert global_generator.offset == 100 + 8 + 24 + 8  # as if the halves had drawn from it
        for half in reversed(halves):  # the backward's recomputes, last half first
            with HalfGenerators(half.start) as replay:
                replay.generator(cuda)
    assert plan.forks == [(cuda, 8), (cuda, 32)] and plan.replays == [1, 0]
    assert plan.prepare() == plan.generators  # (to register with the graph: both on CUDA)
    global_generator.manual_seed(11).draw(40)  # the user reseeds; something draws between steps
    plan.place()
    assert [g.get_state() for g in plan.generators] == [(11, 40 + 32), (11, 40 + 8)]
    global_generator.draw(4)
    plan.place()  # each replay from where the global generator stands then
    assert [g.get_state() for g in plan.generators] == [(11, 44 + 32), (11, 44 + 8)]
