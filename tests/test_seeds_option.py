"""The suite's `--seeds N` option (tests/conftest.py, issue 46): every test that takes the `seeded`
fixture runs N times, each under a fresh seed; a failure's report names its seed, and
REVTRITON_TEST_SEED reruns a test under it."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
def test_records(seeded, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / f"seed-{seeded}").touch()

def test_fails_under_odd_seeds(seeded):
    assert seeded % 2 == 0
'''


def run_probe(tmp_path, *args, seed=None):
    root = tmp_path / "probe"
    root.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).with_name("conftest.py"), root / "conftest.py")
    (root / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("REVTRITON_TEST_SEED", None)
    if seed is not None:
        env["REVTRITON_TEST_SEED"] = str(seed)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--basetemp", str(tmp_path / "base"), *args, str(root)],
                          capture_output=True, text=True, timeout=120, cwd=root, env=env)


def test_seeds_runs_each_seeded_test_under_fresh_seeds_and_names_a_failing_one(tmp_path):
    out = run_probe(tmp_path, "--seeds", "6", "-k", "records")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 passed" in out.stdout
    assert len(list(tmp_path.glob("seed-*"))) == 6  # six distinct seeds (2**-32 odds of a clash aside)
    out = run_probe(tmp_path, "-k", "fails", seed=3)  # an odd seed, given
    assert out.returncode == 1 and "REVTRITON_TEST_SEED=3" in out.stdout, out.stdout
    assert run_probe(tmp_path, "-k", "fails", seed=4).returncode == 0
    out = run_probe(tmp_path, "--seeds", "0")
    assert out.returncode != 0 and re.search(r"--seeds must be at least 1", out.stdout + out.stderr)
