"""What every section of `sluice.yaml` shares: strict models (an unknown key is an error), secrets given
inline or read from a mounted file, certificate and key files that come in pairs, and API keys stored only
as hashes. The sections themselves live in common/trust_settings.py (where a process connects and how
each hop proves itself) and common/serving_settings.py (what a router and a worker do); common/config.py
assembles them into `SluiceConfig` and loads it.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr


class Section(BaseModel):
    """A section of `sluice.yaml`: unknown keys are errors and defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


def secret_from(value: SecretStr | None, path: Path | None, key: str) -> SecretStr | None:
    """The secret given inline (`value`) or in the file at `path`, not both; ValueError naming `key`."""
    if path is None:
        return value
    if value is not None:
        raise ValueError(f"set {key.removesuffix('_file')} or {key}, not both")
    return read_secret(path, key)


def read_secret(path: Path, key: str) -> SecretStr:
    """The secret held in a file (a mounted Kubernetes Secret), without its trailing newline; ValueError
    naming `key` when it cannot be read or is empty. The value itself never appears in a message."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc}") from None
    if not text:
        raise ValueError(f"{key}: {path} is empty")
    return SecretStr(text)


def require_pair(cert_file: Path | None, key_file: Path | None) -> None:
    """A certificate file and its key file are set together or not at all (ValueError otherwise)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together: set both or neither")


_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def check_key_hashes(value: list[str]) -> list[str]:
    """API keys as configured: each a `sha256:` hash (`sluice keys hash KEY`), never the key itself."""
    bad = [k for k in value if not _KEY_HASH.match(k)]
    if bad:
        raise ValueError("each key must be 'sha256:' + 64 lowercase hex digits (see `sluice keys hash`)")
    return value
