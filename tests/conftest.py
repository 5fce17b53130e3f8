"""Test setup: Triton runs on the CPU interpreter (must be set before triton is imported)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist (the README's `-n auto`): its workers share the cores, and torch's default of a thread
# per core in each worker would oversubscribe them (N workers x N threads).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


SEED_ENV = "REVTRITON_TEST_SEED"


def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=1, metavar="N",
                     help="run every test that takes the `seeded` fixture N times, each under a fresh seed "
                          f"(a failure prints its seed; {SEED_ENV}=S reruns it)")


def pytest_generate_tests(metafunc):
    rounds = metafunc.config.getoption("seeds")
    if rounds < 1:
        raise pytest.UsageError(f"--seeds must be at least 1, got {rounds}")
    if rounds > 1 and "seeded" in metafunc.fixturenames:
        metafunc.parametrize("seeded", range(rounds), indirect=True, ids=[f"seed{i}" for i in range(rounds)])


@pytest.fixture
def seeded(request):
    """A fresh seed per test run so inputs are never fixed (``--seeds N``: N runs, each its own seed).
    A failure's report names it; ``REVTRITON_TEST_SEED=S`` runs the test under seed S."""
    fixed = os.environ.get(SEED_ENV)
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    request.node.revtriton_seed = seed
    torch.manual_seed(seed)
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = getattr(item, "revtriton_seed", None)
    if seed is not None and report.failed:
        report.sections.append(("seed", f"seeded = {seed}; rerun under it with {SEED_ENV}={seed}"))


@pytest.fixture
def one_thread():
    """Tiny models: one thread is fastest, and far faster than two on a loaded 2-core machine (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
