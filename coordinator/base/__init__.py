"""What every room of the coordinator stands on.

The bottom room: it imports no other.

    errors.py       the coordinator's exception tree (and which errors are transient)
    config.py       the config tree (TOML + env + flags) and its readable errors
    config_file.py  reading the TOML file and the state directory without the whole config
    redact.py       secrets never printed: masked values in errors, a filter for log lines
    limits.py       per-client limits: rate limits (failed auth per address, requests per node),
                    body and request-head timeouts, aiohttp's connection settings (here, as the
                    config tree embeds their settings)
"""
