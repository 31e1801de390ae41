import os

import pytest
import torch

# Tiny test models gain nothing from intra-op threads, and on a loaded 2-core runner
# small ops at 2 threads stall; the suite runs single-threaded.
torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a real-model test never passes by skipping: `factories.require_smollm2` fails when the
    model is missing, and this turns any other skip of a `@pytest.mark.model` test into a failure too."""
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("CI") and rep.skipped and item.get_closest_marker("model") is not None and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        why = rep.longrepr[-1] if isinstance(rep.longrepr, tuple) else rep.longrepr
        rep.longrepr = f"CI is set: the real-model test {item.nodeid} was skipped ({why})"


# Daemons the suite starts (in-process and as subprocesses) persist sessions under a directory of
# their own, never the machine's $KAKEYA_HOME/state (a daemon running there holds its lock). One per
# pytest-xdist worker: workers inherit the controller's environment, and two workers' daemons in one
# directory would meet each other's lock (seen: a README example's daemon refused to start).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if "KAKEYA_STATE_DIR" not in os.environ or os.environ.get("KAKEYA_TEST_STATE_WORKER", "") != _worker:
    import atexit
    import shutil
    import tempfile

    os.environ["KAKEYA_STATE_DIR"] = tempfile.mkdtemp(prefix=f"kakeya-test-state-{_worker or 'main'}-")
    os.environ["KAKEYA_TEST_STATE_WORKER"] = _worker
    atexit.register(shutil.rmtree, os.environ["KAKEYA_STATE_DIR"], True)
