"""Test setup: Triton runs on the CPU interpreter (must be set before triton is imported)."""
import gc
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


def _cache_the_interpreters_builtin_lists():
    """Triton's interpreter re-patches ``triton.language`` at every call of a ``@triton.jit`` helper
    (``_patch_lang``), listing each patched namespace's members with ``inspect.getmembers`` each time:
    about a tenth of an interpreted attention kernel's time (more under cProfile). The builtins a
    namespace holds never change, so list them once. The same patching as before: a builtin is
    patched when the namespace holds it unpatched (the original patches what ``is_builtin`` says is
    one: the unpatched builtins). Left as it is when this Triton lacks the private functions."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:
        return
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if getattr(interpreter, "_patch_builtin", None) is None or patch_attr is None or is_builtin is None:
        return
    import inspect

    builtins_of = {}  # id(namespace) -> (namespace, its builtins as (name, function)), first seen unpatched

    def patch_builtin(pkg, builder, scope):
        entry = builtins_of.get(id(pkg))
        if entry is None:
            entry = builtins_of[id(pkg)] = (pkg, [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)])
        for name, member in entry[1]:
            if getattr(pkg, name, None) is member:
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


_cache_the_interpreters_builtin_lists()


# The collector's full passes walk every object a worker holds: torch's, transformers', triton's
# modules and what the earlier tests left cached, about 2 million objects late in a run, half a
# second a pass. Python runs one whenever enough new objects outlived the younger generations, and
# the perf scripts run one per measured point (perf/measure.py): 110 of a 2-worker run's 600 CPU
# seconds went to them. So at each new test module whatever is alive is collected once and then
# frozen (gc.freeze: left out of later passes; still freed by its reference count): the passes then
# walk only what the module's own tests made. The cost: what was alive then and dies later inside a
# reference cycle is never collected (a worker's peak RSS 3.0 -> 3.6 GB on the 2-core machine).
_module_frozen_for = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    module = getattr(item, "module", None)
    if module is not None and module is not _module_frozen_for[0]:
        _module_frozen_for[0] = module
        gc.collect()
        gc.freeze()

# Tests that share a module-scoped fixture (a spawned process group, the quick sweep, the static
# gate's compiles: 15-65 s each) form one xdist group: under `-n auto --dist loadgroup` (the README's
# command) they run on one worker, which builds the fixture once. xdist's default scheduling ("load")
# hands such a module's tests to every worker, and each builds the fixture again. The other tests
# are scheduled as under "load". (tryfirst: xdist's worker reads the groups in its own hook.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # the fixtures a test uses, with their definitions
        if info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(f"module-fixtures-of-{item.nodeid.split('::')[0]}"))


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


@pytest.fixture(autouse=True)
def _no_runners_from_earlier_tests():
    """Each test starts with no bound runners (``ops.dispatch.run_bound`` keeps them per process, by
    call signature): a test that spies on a layer below the dispatch (a candidate, the choice) sees
    its calls whatever ran before it on this worker."""
    from revtriton.ops import dispatch

    dispatch.forget_runners()
