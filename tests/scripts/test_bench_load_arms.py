"""scripts/bench_agentic/bench_load.py's kakeya arm names -> the daemon flags each arm runs with."""
import sys
from importlib import util

from factories import ROOT


def _script():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = util.spec_from_file_location("bench_load", ROOT / "scripts" / "bench_agentic" / "bench_load.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arm_names_give_the_daemon_flags():
    parse = _script().parse_arm
    assert parse("batching-on") == ("on", None, None, "off", None)
    assert parse("batching-off-chunk32") == ("off", 32, None, "off", None)
    assert parse("batching-on-shared16") == ("on", None, 16, "off", None)
    assert parse("batching-on-chunk64-shared16-auto") == ("on", 64, 16, "auto", None)
    assert parse("batching-on-compile") == ("on", None, None, "on", None)
    assert parse("batching-on-auto-int8") == ("on", None, None, "auto", "int8")
    assert parse("batching-on-shared8-auto-int8") == ("on", None, 8, "auto", "int8")
