"""`kakeya serve` arguments: product flags, and the research knobs behind --research-* only."""
import pytest

from inference_engine.server.cli import build_parser, serve_config
from inference_engine.server.config import ServeConfig


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_serve_config_defaults():
    cfg = serve_config(serve_args())
    assert cfg == ServeConfig(api_key=cfg.api_key)  # the key may come from KAKEYA_API_KEY
    assert cfg.research == {}  # every research option at its default


def test_research_knobs_are_reachable_only_behind_research_flags():
    cfg = serve_config(serve_args("--kv-strategy", "dlm_restore", "--drafter", "d", "--research-restore-from", "drafter",
                                  "--research-restore-refresh", "3", "--research-restore-pin", "16",
                                  "--research-restore-bias", "calibrated"))
    assert cfg.research == {"restore_from": "drafter", "restore_refresh": 3, "restore_pin": 16, "restore_bias": "calibrated"}
    for old in ("--restore-from", "--restore-refresh", "--restore-pin", "--restore-bias"):
        with pytest.raises(SystemExit):
            serve_args(old, "1")


def test_help_groups_the_research_flags_apart(capsys):
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = capsys.readouterr().out.partition("options:")[2]  # past the usage line, which lists every flag
    product, _, research = text.partition("research (not product surface):")
    assert research, "the research flags have their own group"
    flags = lambda section: {line.split()[0] for line in section.splitlines() if line.startswith("  --")}  # noqa: E731
    assert flags(research) == {"--research-restore-from", "--research-restore-refresh", "--research-restore-pin",
                               "--research-restore-bias"}
    assert not {f for f in flags(product) if "restore" in f or f.startswith("--research")}
