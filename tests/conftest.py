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


@pytest.fixture
def seeded():
    """A fresh seed per test run (printed on failure) so inputs are never fixed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def one_thread():
    """Tiny models: one thread is fastest, and far faster than two on a loaded 2-core machine (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
