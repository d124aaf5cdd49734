"""Settings of the daemon's log: ``[logging]``."""

from __future__ import annotations

from typing import Literal

from kvstore.config.section import Section, setting


class LoggingSettings(Section):
    flag_prefix = "log_"
    title = "log lines on stderr"

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = setting("INFO", "log level")
    format: Literal["auto", "json", "text"] = setting(
        "auto", "log lines as JSON objects or plain text; auto: plain text on a terminal, JSON otherwise (a container, "
        "a pipe, a file)",
    )
