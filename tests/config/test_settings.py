"""The settings dataclasses (config/settings.py) are where the CLI's options come from: each option's default and
help is its field's, a bound in its type is checked naming the flag, and the server's config built from `serve`'s
options holds the same values as the settings' defaults."""
import argparse
import dataclasses

import pytest

from omni_tts.config.options import add_options, check_bounds, from_options
from omni_tts.config.settings import ApiSettings, ListenerSettings, NarrationSettings, SupervisionSettings
from omni_tts.entrypoints.api.server_config import ServerConfig
from omni_tts.entrypoints.cli.commands import build_parser, parse_args

SERVER_SETTINGS = (ListenerSettings, ApiSettings, SupervisionSettings)


def options_of(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action for action in commands.choices[command]._actions}


@pytest.mark.parametrize("command,settings", [("serve", SERVER_SETTINGS), ("serve-ray", SERVER_SETTINGS),
                                              ("narrate", (NarrationSettings,))])
def test_each_option_is_a_settings_field_with_its_default_and_help(command, settings):
    options = options_of(command)
    for cls in settings:
        for f in dataclasses.fields(cls):
            if "option" not in f.metadata:
                continue
            assert options[f.name].default == f.default, f.name
            assert options[f.name].help == f.metadata["option"].help, f.name


def test_serve_s_defaults_build_the_server_config_of_the_settings_defaults():
    args = parse_args(build_parser(), ["serve"])
    config = from_options(ServerConfig, args, served_model_names=("m",))
    assert dataclasses.asdict(config) == dataclasses.asdict(ServerConfig(served_model_names=("m",)))
    assert from_options(SupervisionSettings, args) == SupervisionSettings()
    assert config.voices_quota_bytes == 1024 * 2**20


@pytest.mark.parametrize("settings,message", [
    (ApiSettings(max_queue=0), "--max-queue must be >= 1, got 0"),
    (ApiSettings(request_timeout=0.0), "--request-timeout must be > 0, got 0.0"),
    (ApiSettings(max_input_chars=5_000_000), "--max-input-chars must be in 1..4000000, got 5000000"),
    (ApiSettings(segment_chars=19), "--segment-chars must be >= 20, got 19"),
    (SupervisionSettings(heartbeat_timeout=-1.0), "--stage-heartbeat-timeout must be > 0, got -1.0"),
    (SupervisionSettings(max_restarts=-1), "--max-restarts must be >= 0, got -1"),
    (NarrationSettings(paragraph_pause_ms=10_001), "--paragraph-pause-ms must be in 0..10000, got 10001"),
])
def test_a_value_outside_its_type_s_bounds_is_refused_naming_the_flag(settings, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_bounds(settings)
    check_bounds(type(settings)())  # the defaults are within them


def test_a_bool_setting_is_a_switch_and_a_list_setting_comes_back_as_a_tuple():
    parser = argparse.ArgumentParser()
    add_options(parser, ApiSettings)
    settings = from_options(ApiSettings, parser.parse_args(
        ["--no-openai-aliases", "--strict-fields", "--allowed-origins", "https://a.example", "*"]))
    assert (settings.openai_aliases, settings.strict_fields) == (False, True)
    assert settings.allowed_origins == ("https://a.example", "*")
