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


def test_page_ram_and_spill_dir_flags_reach_the_config_and_the_paged_strategy():
    d = serve_config(serve_args())
    assert (d.page_ram_mb, d.page_spill_dir) == (128, None)
    cfg = serve_config(serve_args("--kv-strategy", "paged", "--page-ram-mb", "0", "--page-spill-dir", "/somewhere"))
    assert (cfg.page_ram_mb, cfg.page_spill_dir) == (0, "/somewhere")
    assert cfg.strategy()[0].page_ram_mb == 0  # as page_shortlist -> shortlist_pages
    assert serve_config(serve_args("--kv-strategy", "paged", "--page-ram-mb", "7")).strategy()[0].page_ram_mb == 7


def test_negative_page_ram_is_refused_naming_the_flag():
    from inference_engine.server.config import ConfigError

    with pytest.raises(ConfigError, match="--page-ram-mb"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-ram-mb", "-1")).validate()


def test_help_says_what_the_page_ram_and_spill_flags_do(capsys):
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--page-ram-mb MB" in text and "memory-mapped spill file" in text and "0 = keep every page in RAM" in text
    assert "--page-spill-dir DIR" in text and "<state dir>/spill" in text


def test_spill_dir_default_is_under_the_state_dir_when_persisted_else_the_temp_dir(tmp_path):
    from inference_engine.server.app import spill_dir

    assert spill_dir(ServeConfig(state_dir=str(tmp_path), persist="turn")) == str(tmp_path / "spill")
    assert spill_dir(ServeConfig(state_dir=str(tmp_path), persist="off")) is None  # the system temp dir
    assert spill_dir(ServeConfig(state_dir=str(tmp_path), page_spill_dir=str(tmp_path / "x"))) == str(tmp_path / "x")


def test_the_server_sets_the_spill_dir_once_creating_it(tmp_path, monkeypatch):
    from inference_engine.kv import paged_store
    from inference_engine.server.app import ConfigError, use_spill_dir

    calls = []
    monkeypatch.setattr(paged_store, "set_spill_dir", calls.append)
    assert use_spill_dir(ServeConfig(state_dir=str(tmp_path), persist="turn")) == str(tmp_path / "spill")
    assert (tmp_path / "spill").is_dir() and not list((tmp_path / "spill").iterdir())  # the write check left nothing
    assert use_spill_dir(ServeConfig(persist="off")) is None
    assert calls == [str(tmp_path / "spill"), None]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--page-spill-dir"):  # refused at start, not at the first spill
        use_spill_dir(ServeConfig(page_spill_dir=str(tmp_path / "file" / "spill")))
    assert len(calls) == 2


def test_page_far_from_reaches_the_paged_strategy_and_is_checked():
    from inference_engine.server.config import ConfigError

    assert serve_config(serve_args()).strategy()[0].far_from == 0  # the trained context
    cfg = serve_config(serve_args("--kv-strategy", "paged", "--page-far-from", "4096"))
    assert cfg.strategy()[0].far_from == 4096 and cfg.strategy()[0].describe()["far_from"] == "4096"
    with pytest.raises(ConfigError, match=r"far_from must be 0 .* >= sink \+ window \+ recall_pages \* page_size = 1024"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-far-from", "1000")).validate()
    with pytest.raises(ConfigError, match="far_from applies to the paged strategy only"):
        serve_config(serve_args("--kv-strategy", "sink_window", "--page-far-from", "4096")).validate()
    with pytest.raises(ConfigError, match="--page-far-from 4096 runs on --backend torch only"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-far-from", "4096", "--backend", "mlx")).validate()


def test_the_window_defaults_per_strategy_and_an_explicit_one_wins():
    """paged's default window is the one its recall, memory and decode figures were measured with (508); the other
    strategies keep 1020; --window N sets any strategy's."""
    assert serve_config(serve_args()).strategy()[0].window == 1020  # sink_window
    assert serve_config(serve_args("--kv-strategy", "paged")).strategy()[0].window == 508
    assert serve_config(serve_args("--kv-strategy", "paged")).strategy()[0].describe()["window"] == "508"
    assert serve_config(serve_args("--kv-strategy", "paged", "--window", "1020")).strategy()[0].window == 1020
    assert serve_config(serve_args("--kv-strategy", "sink_window", "--window", "64")).strategy()[0].window == 64


def test_page_far_layout_reaches_the_paged_strategy_and_is_checked():
    from inference_engine.server.config import ConfigError

    assert serve_config(serve_args("--kv-strategy", "paged")).strategy()[0].describe()["far_layout"] == "packed"
    cfg = serve_config(serve_args("--kv-strategy", "paged", "--page-far-from", "4096", "--page-far-layout", "spread"))
    assert cfg.strategy()[0].far_layout == "spread" and cfg.strategy()[0].describe()["far_layout"] == "spread"
    with pytest.raises(SystemExit):
        serve_args("--page-far-layout", "near")
    with pytest.raises(ConfigError, match="far_layout applies to the paged strategy only"):
        serve_config(serve_args("--kv-strategy", "sink_window", "--page-far-layout", "spread")).validate()
    with pytest.raises(ConfigError, match="--page-far-layout spread runs on --backend torch only"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-far-layout", "spread", "--backend", "mlx")).validate()


def test_page_choice_every_reaches_the_paged_strategy_and_is_checked():
    from inference_engine.server.config import ConfigError

    # paged's default on torch (PAGED_CHOICE_EVERY, the pre-registered ladder check past the context): 4; given: as given
    assert serve_config(serve_args("--kv-strategy", "paged")).strategy()[0].choice_every == 4
    cfg = serve_config(serve_args("--kv-strategy", "paged", "--page-choice-every", "1"))
    assert cfg.strategy()[0].choice_every == 1 and "choice_every" not in cfg.strategy()[0].describe()
    assert serve_config(serve_args("--kv-strategy", "paged")).strategy()[0].describe()["choice_every"] == "4"
    # on MLX (paged stops at the trained context there) the default is 1, and other strategies keep 1
    serve_config(serve_args("--kv-strategy", "paged", "--backend", "mlx")).validate()
    assert serve_config(serve_args("--kv-strategy", "paged", "--backend", "mlx")).resolved_choice_every == 1
    assert serve_config(serve_args()).strategy()[0].choice_every == 1
    with pytest.raises(ConfigError, match="choice_every must be an int >= 1"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-choice-every", "0")).validate()
    with pytest.raises(ConfigError, match="choice_every applies to the paged strategy only"):
        serve_config(serve_args("--kv-strategy", "sink_window", "--page-choice-every", "2")).validate()
    with pytest.raises(ConfigError, match="--page-choice-every 2 runs on --backend torch only"):
        serve_config(serve_args("--kv-strategy", "paged", "--page-choice-every", "2", "--backend", "mlx")).validate()
