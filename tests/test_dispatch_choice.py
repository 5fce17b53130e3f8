"""Measured choice between an op's implementations (issue 19), on CPU with a fake device timer.

The machinery (revtriton.ops.backend) is the one a GPU uses: only the timer is fake (a dict of
milliseconds per candidate), and besides the real ``triton`` (interpreter) and ``torch``
candidates some tests register fake ones on the real ``norm_mlp`` op: deterministic ones that
compute the reference couple, and a non-deterministic one that adds noise.
"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from revtriton import LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack
from revtriton.ops import backend, dispatch, mlp
from revtriton.ops.streams import couple_output, to_fixed

from ranks import run_ranks

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RAN = []  # fake candidates that ran in this process, in order


def fake_run(name, noise=0.0):
    def run(res, x, sign, frac_bits, *weights, **options):
        RAN.append(name)
        h = mlp.norm_mlp_reference(x, *weights, **options)
        if noise:
            h = h + noise * torch.randn_like(h)  # a different answer every run
        return couple_output(res, h, sign, frac_bits)
    return run


@contextlib.contextmanager
def fake_candidates(*specs):
    """Register fake candidates (name, noise) on the real norm_mlp op for the block's duration."""
    for name, noise in specs:
        backend.register_candidate("norm_mlp", name, fake_run(name, noise))
    try:
        yield
    finally:
        for name, _ in specs:
            backend.unregister_candidate("norm_mlp", name)


class FakeTimer:
    """A device timer that answers from a table (ms per candidate) and records what it timed."""

    def __init__(self, ms):
        self.ms, self.calls = dict(ms), []

    def __call__(self, run, *, op, candidate):
        self.calls.append((op, candidate))
        return self.ms[candidate]


def mlp_call(exact=True, grad=True, seed=0):
    """A LayerNormMLP half and one couple call's inputs (dim 32, hidden 64, 2 x 4 tokens)."""
    torch.manual_seed(seed)
    half = LayerNormMLP(32, 64).requires_grad_(grad)
    x = torch.randn(2, 4, 32)
    res = to_fixed(torch.randn(2, 4, 32), 16) if exact else torch.randn(2, 4, 32)
    return half, res, x, (16 if exact else None)


def couple(half, res, x, frac_bits):
    return half.couple(res, x, +1, frac_bits)


def the_decision(op="norm_mlp"):
    found = [d for d in backend.decisions() if d["op"] == op]
    assert len(found) == 1, backend.decisions()
    return found[0]


def cache_files(directory):
    return sorted(p for p in os.listdir(directory) if p.endswith(".json"))


@pytest.fixture(autouse=True)
def fresh_backend(tmp_path, monkeypatch):
    """Each test: no pinned choices, its own cache directory, no override in the environment."""
    monkeypatch.setenv(backend.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(backend.ENV_BACKEND, raising=False)
    backend.reset()
    RAN.clear()
    yield
    backend.reset()


# --------------------------------------------------------------------------------------------
# 1. Fastest eligible candidate; cache written; read by a second process; corrupt / stale files


def test_a_choice_key_is_built_once_per_call_signature(monkeypatch):
    """The dispatch builds an op's key string once per call signature (issue 44 step 5: about as
    much host time as the rest of the dispatch), and a call that differs in what the key says
    (here autocast's dtype, a shape bucket) still gets a key, and a choice, of its own."""
    op = backend.ops()["norm_mlp"]
    real, built = op.key, []
    monkeypatch.setattr(op, "key", lambda args, options: built.append(options) or real(args, options))
    half, res, x, frac_bits = mlp_call(exact=False, grad=False)
    with backend.use_timer(FakeTimer({"torch": 1.0})):
        for _ in range(3):
            couple(half, res, x, frac_bits)
        assert len(built) == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            couple(half, res, x, frac_bits)
        couple(half, torch.cat([res] * 3), torch.cat([x] * 3), frac_bits)
        couple(half, res, x, frac_bits)
    assert len(built) == 3
    keys = sorted(d["key"] for d in backend.decisions())
    assert len(keys) == 3 and sum("autocast bfloat16" in k for k in keys) == 1, keys


def test_a_kept_choice_follows_what_it_depends_on(monkeypatch, tmp_path):
    """A call signature's choice is made once and then looked up (issue 44 step 5), but a change of
    what it depends on is seen at the next call: force_triton, the override (context manager or
    environment), backend.reset(), a candidate registered again."""
    made = []
    real = backend._choose
    monkeypatch.setattr(backend, "_choose", lambda *a: made.append(a[0]) or real(*a))
    half, res, x, frac_bits = mlp_call(exact=False, grad=False)
    launched = []
    for forced in (False, True, False):  # force_triton: the interpreter's kernels, else the reference
        with dispatch.force_triton(forced), dispatch.count_launches() as launches:
            couple(half, res, x, frac_bits)
        launched.append(launches.total())
    assert launched[0] == launched[2] == 0 < launched[1]
    made.clear()
    timer = FakeTimer({"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0})
    with backend.use_timer(timer):
        with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)):
            couple(half, res, x, frac_bits)  # measured (the candidates run), chosen
            RAN.clear()
            for _ in range(2):
                couple(half, res, x, frac_bits)
            assert RAN == ["fake_a"] * 2 and len(made) == 1
            with backend.use_backend("fake_b"):
                couple(half, res, x, frac_bits)
            monkeypatch.setenv(backend.ENV_BACKEND, "torch")
            couple(half, res, x, frac_bits)  # the torch reference: no fake runs
            monkeypatch.delenv(backend.ENV_BACKEND)
            couple(half, res, x, frac_bits)
            assert RAN[2:] == ["fake_b", "fake_a"]
            backend.reset()
            monkeypatch.setenv(backend.ENV_CACHE_DIR, str(tmp_path / "another"))  # (not the one it wrote)
            timer.ms = {"torch": 3.0, "fake_a": 2.0, "fake_b": 1.0}
            couple(half, res, x, frac_bits)  # measured again after the reset
            assert RAN[-1] == "fake_b"
            with backend.use_backend("fake_b"):
                couple(half, res, x, frac_bits)
        backend.register_candidate("norm_mlp", "fake_b", fake_run("fake_b again"))  # another under its name
        try:
            with backend.use_backend("fake_b"):
                couple(half, res, x, frac_bits)
        finally:
            backend.unregister_candidate("norm_mlp", "fake_b")
        assert RAN[-2:] == ["fake_b", "fake_b again"]


def test_a_hiccup_in_one_round_does_not_decide():
    """The choice is each candidate's median over rounds that alternate the candidates: one slow
    round of the fastest one (a host stall, a clock ramp) does not hand the choice to another."""
    class HiccupTimer(FakeTimer):
        def __call__(self, run, *, op, candidate):
            first = (op, candidate) not in self.calls
            ms = super().__call__(run, op=op, candidate=candidate)
            return 100.0 if first and candidate == "fake_a" else ms

    timer = HiccupTimer({"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0})
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(timer):
        couple(*mlp_call())
    assert the_decision()["choice"] == "fake_a" and the_decision()["times_ms"]["fake_a"] == 1.0


def second_process_run():
    """What the second process of test 1 does: same call, a timer that would pick fake_b."""
    timer = FakeTimer({"torch": 3.0, "fake_a": 2.0, "fake_b": 1.0})
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(timer):
        couple(*mlp_call())
    return {"timed": timer.calls, "ran": RAN, "decisions": backend.decisions()}


def test_fastest_candidate_is_chosen_cached_and_read_by_a_second_process(tmp_path, capfd):
    timer = FakeTimer({"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0})
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(timer):
        half, res, x, k = mlp_call()
        stream, port = couple(half, res, x, k)
        RAN.clear()
        couple(half, res, x, k)  # pinned: no timing, runs the winner
    # every candidate timed once a round, the rounds alternating the candidates
    assert timer.calls == timer.calls[:3] * backend.ROUNDS
    assert sorted(timer.calls[:3]) == [("norm_mlp", "fake_a"), ("norm_mlp", "fake_b"), ("norm_mlp", "torch")]
    assert RAN == ["fake_a"]
    record = the_decision()
    assert record["choice"] == "fake_a" and record["source"] == "measured"
    assert record["times_ms"] == {"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0}
    assert "triton" not in record["times_ms"]  # cannot run on CPU tensors outside force_triton
    # the result is the reference couple, with a port for the backward
    args, options = half.operands(x)
    want, _ = couple_output(res, mlp.norm_mlp_reference(x, *args, **options), 1, 16)
    assert torch.equal(stream, want) and port is not None
    # one line of progress on stderr
    err = capfd.readouterr().err
    assert "revtriton: norm_mlp [" in err and "-> fake_a" in err and "torch 3.000 ms" in err
    # the cache: one file for this device, the choice and both timings
    (name,) = cache_files(tmp_path / "cache")
    doc = json.loads((tmp_path / "cache" / name).read_text())
    assert doc["fingerprint"]["torch"] == torch.__version__
    (entry,) = doc["entries"].values()
    assert entry["choice"] == "fake_a" and entry["times_ms"]["fake_b"] == 2.0

    # a second process reads it and times nothing (its timer would have picked fake_b)
    script = f"import json, sys; sys.path.insert(0, {TESTS_DIR!r}); import test_dispatch_choice as t; " \
             f"print(json.dumps(t.second_process_run()))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")})
    assert out.returncode == 0, out.stderr
    second = json.loads(out.stdout.strip().splitlines()[-1])
    assert second["timed"] == [] and second["ran"] == ["fake_a"]
    assert second["decisions"][0]["source"] == "cache" and second["decisions"][0]["choice"] == "fake_a"


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "stale", "not a dict", "nested too deep"])
def test_a_bad_cache_file_warns_and_gives_a_fresh_choice(tmp_path, damage):
    ms = {"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0}
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(FakeTimer(ms)):
        couple(*mlp_call())
    (name,) = cache_files(tmp_path / "cache")
    path = tmp_path / "cache" / name
    doc = json.loads(path.read_text())
    if damage == "corrupt":
        path.write_bytes(b"\x00\xffnot json{{{")
    elif damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "nested too deep":  # valid JSON that json.load cannot parse (RecursionError)
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "stale":  # made for another GPU / torch, still naming a choice
        doc["fingerprint"]["torch"] = "0.0.1"
        for entry in doc["entries"].values():
            entry["choice"] = "fake_a"
        path.write_text(json.dumps(doc))
    else:
        path.write_text(json.dumps(["fake_a"]))
    backend.reset()  # as a new process
    RAN.clear()
    timer = FakeTimer({"torch": 3.0, "fake_a": 2.0, "fake_b": 1.0})  # now fake_b is the fastest
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(timer):
        with pytest.warns(RuntimeWarning, match="backend cache .* (corrupt|stale)"):
            couple(*mlp_call())
        assert len(timer.calls) == 3 * backend.ROUNDS and the_decision()["choice"] == "fake_b"
        RAN.clear()
        couple(*mlp_call())
    assert RAN == ["fake_b"]
    rebuilt = json.loads(path.read_text())  # rewritten, valid, with the fresh choice
    assert rebuilt["fingerprint"] == backend.fingerprint(torch.device("cpu"))
    assert [e["choice"] for e in rebuilt["entries"].values()] == ["fake_b"]


def write_entries(path, first, count, start):
    """Write ``count`` cache entries one by one, as a process that measures ``count`` shapes, from
    when both writers are ready (``start``: a barrier)."""
    fp = backend.fingerprint(torch.device("cpu"))
    start.wait()
    for i in range(first, first + count):
        backend._write_cache(path, fp, f"key {i}", {"choice": "torch"})


def test_two_processes_writing_the_cache_at_once_lose_no_entry(tmp_path):
    """Issue 39: each write is a read-modify-write of the whole file; two writers at once, unlocked,
    lost up to 45% of one writer's entries (a re-measurement each). Under the file lock, none."""
    path = str(tmp_path / "cache" / "backend-cpu-test.json")
    count = 200
    ctx = torch.multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    writers = [ctx.Process(target=write_entries, args=(path, w * count, count, start)) for w in range(2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
    assert all(p.exitcode == 0 for p in writers)
    entries = json.loads(open(path).read())["entries"]
    assert set(entries) == {f"key {i}" for i in range(2 * count)}


def test_a_cached_choice_that_cannot_run_here_is_measured_again(tmp_path):
    with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(FakeTimer(
            {"torch": 3.0, "fake_a": 1.0, "fake_b": 2.0})):
        couple(*mlp_call())
    backend.reset()
    timer = FakeTimer({"torch": 3.0, "fake_b": 2.0})
    with fake_candidates(("fake_b", 0.0)), backend.use_timer(timer):  # fake_a is gone
        with pytest.warns(RuntimeWarning, match="cannot run here"):
            couple(*mlp_call())
    assert the_decision()["choice"] == "fake_b" and len(timer.calls) == 2 * backend.ROUNDS


# --------------------------------------------------------------------------------------------
# 2. Exact mode: only candidates whose two runs are bitwise equal


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_a_non_deterministic_candidate_is_never_chosen_in_exact_mode(exact):
    timer = FakeTimer({"torch": 3.0, "noisy": 1.0})
    with fake_candidates(("noisy", 1e-3)), backend.use_timer(timer):
        half, res, x, k = mlp_call(exact=exact)
        stream, _ = couple(half, res, x, k)
        back, _ = half.couple(stream, x, -1, k)
    record = the_decision()
    if exact:
        assert RAN == ["noisy", "noisy"]  # the two runs of the check, and never again
        assert record["choice"] == "torch"
        assert "noisy" in record["excluded"] and "not deterministic" in record["excluded"]["noisy"]
        assert ("norm_mlp", "noisy") not in timer.calls
        assert torch.equal(back, res)  # the forward and the inverse agree bitwise
    else:
        assert record["choice"] == "noisy" and record["excluded"] == {}
        assert RAN == ["noisy"] * 3  # measured once, then the forward and the inverse


def test_a_candidate_that_raises_is_excluded_not_fatal():
    def broken(*args, **options):
        raise RuntimeError("out of shared memory")

    backend.register_candidate("norm_mlp", "broken", broken)
    try:
        with backend.use_timer(FakeTimer({"torch": 3.0, "broken": 1.0})):
            couple(*mlp_call())
    finally:
        backend.unregister_candidate("norm_mlp", "broken")
    record = the_decision()
    assert record["choice"] == "torch" and "out of shared memory" in record["excluded"]["broken"]


# --------------------------------------------------------------------------------------------
# 3. The choice of a step holds from its forward to its backward (exact stacks stay bitwise)


# The attention half's sub-op mixes (ops/attention.py) also run under force_triton: slower here.
MIX_TIMES = {"triton_gemm_sdpa": 3.0, "torch_gemm_flash": 3.0}


def small_stack(seed):
    torch.manual_seed(seed)
    blocks = [ReversibleBlock(LayerNormAttention(32, 2), LayerNormMLP(32, 64)) for _ in range(2)]
    return ReversibleStack(blocks, exact=True, frac_bits=22)


def step(stack, x, g):
    x = x.clone().requires_grad_()
    out = stack(x)
    return out, lambda: (out.backward(g), [x.grad] + [p.grad for p in stack.parameters()])[1]


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
def test_a_cache_rewritten_between_forward_and_backward_changes_nothing(tmp_path):
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    timer = FakeTimer({"triton": 1.0, "torch": 2.0, **MIX_TIMES})
    with dispatch.force_triton(), backend.use_timer(timer):
        stack = small_stack(1)
        out, backward = step(stack, x, g)
        assert {(d["op"], d["choice"], d["source"]) for d in backend.decisions()} == {
            ("norm_attention", "triton", "measured"), ("norm_mlp", "triton", "measured")}
        timed = len(timer.calls)
        # another process rewrites the cache: torch everywhere
        (name,) = cache_files(tmp_path / "cache")
        path = tmp_path / "cache" / name
        doc = json.loads(path.read_text())
        for entry in doc["entries"].values():
            entry["choice"] = "torch"
        path.write_text(json.dumps(doc))
        with dispatch.count_launches() as launches:
            grads = backward()  # the rebuild must run the forward's (Triton) kernels: else a checksum error
        assert launches.total() > 0 and len(timer.calls) == timed
    # the same step with Triton named outright: bitwise the same
    with dispatch.force_triton(), backend.use_backend("triton"):
        stack_t = small_stack(1)
        out_t, backward_t = step(stack_t, x, g)
        grads_t = backward_t()
    assert torch.equal(out, out_t)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_t))
    # the rewrite was real: a new process would now take torch from the cache
    backend.reset()
    with dispatch.force_triton(), backend.use_timer(timer):
        small_stack(1)(x)
    assert {d["choice"] for d in backend.decisions()} == {"torch"}
    assert {d["source"] for d in backend.decisions()} == {"cache"}


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
def test_an_override_in_the_forward_is_replayed_in_the_backward():
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    timer = FakeTimer({"triton": 1.0, "torch": 2.0, **MIX_TIMES})  # measured, Triton would win
    with dispatch.force_triton(), backend.use_timer(timer):
        stack = small_stack(2)
        with backend.use_backend("torch"):
            out, backward = step(stack, x, g)
        with dispatch.count_launches() as launches:
            grads = backward()  # outside the override: still the forward's torch path
        assert launches.total() == 0 and timer.calls == [] and backend.decisions() == []
    with backend.use_backend("torch"):
        stack_r = small_stack(2)
        out_r, backward_r = step(stack_r, x, g)
        grads_r = backward_r()
    assert torch.equal(out, out_r) and all(torch.equal(a, b) for a, b in zip(grads, grads_r))


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
@pytest.mark.parametrize("winner", ["triton_gemm_sdpa", "torch_gemm_flash"])
def test_a_sub_op_mix_that_wins_runs_in_forward_and_rebuild(winner):
    """The attention half races its sub-ops' implementations (fused GEMMs or cuBLAS, Triton flash or
    SDPA core) as four candidates; a mix that wins runs in the forward and in the engine's rebuild (a
    rebuild on another candidate fails the exact stack's checksum), and gives the gradients of the
    torch path."""
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    timer = FakeTimer({"triton": 2.0, "torch": 3.0, **MIX_TIMES, winner: 1.0})
    with dispatch.force_triton(), backend.use_timer(timer):
        stack = small_stack(4)
        out, backward = step(stack, x, g)
        with dispatch.count_launches() as launches:
            grads = backward()
    record = the_decision("norm_attention")
    assert record["choice"] == winner and record["source"] == "measured"
    assert set(record["times_ms"]) == {"triton", "torch", "triton_gemm_sdpa", "torch_gemm_flash"}
    assert launches.total() > 0
    with backend.use_backend("torch"):
        out_r, backward_r = step(small_stack(4), x, g)
        grads_r = backward_r()
    assert (out - out_r).abs().max() <= 1e-5 * out_r.abs().max()
    for got, want in zip(grads, grads_r):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


# --------------------------------------------------------------------------------------------
# 4. REVTRITON_BACKEND and use_backend override the choice; unknown values raise


def launches_of(half, res, x, k):
    with dispatch.count_launches() as launches:
        couple(half, res, x, k)
    return launches.total()


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
def test_env_and_context_manager_override_the_choice(monkeypatch):
    call = mlp_call(grad=False)
    timer = FakeTimer({"triton": 2.0, "torch": 1.0})
    with dispatch.force_triton(), backend.use_timer(timer):
        assert launches_of(*call) == 0  # measured: torch is faster, and pinned
        assert the_decision()["choice"] == "torch"
        monkeypatch.setenv(backend.ENV_BACKEND, "triton")
        assert launches_of(*call) == 3  # the environment beats the pinned choice
        with backend.use_backend("torch"):  # the context manager beats the environment
            assert launches_of(*call) == 0
            with backend.use_backend("triton"):
                assert launches_of(*call) == 3
            assert launches_of(*call) == 0
        monkeypatch.setenv(backend.ENV_BACKEND, "TORCH")
        assert launches_of(*call) == 0
        monkeypatch.setenv(backend.ENV_BACKEND, "auto")
        with backend.use_backend("triton"):
            assert launches_of(*call) == 3
        assert launches_of(*call) == 0  # back to the pinned choice
    assert len(timer.calls) == 2 * backend.ROUNDS  # measured once, overrides never measure
    # without force_triton (CPU tensors, no timer) the default is the reference, as before
    assert launches_of(*call) == 0


def test_unknown_backends_raise_clearly(monkeypatch):
    call = mlp_call(grad=False)
    monkeypatch.setenv(backend.ENV_BACKEND, "cuda")
    with pytest.raises(ValueError, match=r"REVTRITON_BACKEND='cuda' is not a backend: use one of auto, triton, torch"):
        couple(*call)
    monkeypatch.delenv(backend.ENV_BACKEND)
    with pytest.raises(ValueError, match=r"use_backend='fastest' is not a backend"):
        with backend.use_backend("fastest"):
            pass
    # Triton named outright on CPU tensors outside force_triton: it cannot run there
    with pytest.raises(RuntimeError, match="backend 'triton' was asked for, but it cannot run norm_mlp on cpu"):
        with backend.use_backend("triton"):
            couple(*call)
    # one op's candidate named for a benchmark: another op called inside says it lacks it
    with pytest.raises(ValueError, match="norm_mlp has no 'triton_gemm_sdpa' implementation"):
        with backend.use_backend("triton_gemm_sdpa"):
            couple(*call)
    assert couple(*call)[0].dtype == torch.int32  # and nothing is left behind


# --------------------------------------------------------------------------------------------
# 5. Every rank uses rank 0's choice (2 processes, gloo)


def gloo_worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    os.environ[backend.ENV_CACHE_DIR] = os.path.join(out_dir, f"cache{rank}")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # each rank's own timer would pick a different candidate
        timer = FakeTimer({"torch": 3.0, "fake_a": 1.0 if rank == 0 else 2.0, "fake_b": 2.0 if rank == 0 else 1.0})
        with fake_candidates(("fake_a", 0.0), ("fake_b", 0.0)), backend.use_timer(timer):
            for exact in (True, False):
                couple(*mlp_call(exact=exact))
            RAN.clear()
            for exact in (True, False):
                couple(*mlp_call(exact=exact))
            dist.barrier()
        result = {"timed": timer.calls, "ran": list(RAN), "decisions": backend.decisions(),
                  "cache": cache_files(os.environ[backend.ENV_CACHE_DIR])
                  if os.path.isdir(os.environ[backend.ENV_CACHE_DIR]) else []}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def test_every_rank_uses_rank_0s_choice(tmp_path):
    run_ranks(gloo_worker, lambda rank: (rank, str(tmp_path / "rendezvous"), str(tmp_path)), 2, 150)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [d["choice"] for d in rank0["decisions"]] == ["fake_a", "fake_a"]
    assert [d["choice"] for d in rank1["decisions"]] == ["fake_a", "fake_a"]
    assert rank0["ran"] == rank1["ran"] == ["fake_a", "fake_a"]  # what each rank then runs
    assert all(d["source"] == "measured" for d in rank0["decisions"])
    assert all(d["source"].startswith("rank 0") for d in rank1["decisions"])
    # rank 0 alone measures (3 candidates x exact, float)
    assert rank1["timed"] == [] and len(rank0["timed"]) == 6 * backend.ROUNDS
    assert len(rank0["cache"]) == 1 and rank1["cache"] == []  # and alone writes its cache
